"""Pulling ahead between real nodes over real ZMQ (kvpeer.node.ahead, kvpeer.router.ahead):
the router's prefetch sender asks a consumer node to fetch a producer's blocks into its
staging rows, on every data plane; the engine's lookup then answers HIT with no peer
asked and its load is a copy of the right bytes. A sender whose address is not in
``prefetch_from`` gets a named refusal and the node dials nobody."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvpeer.errors import ConfigError
from kvpeer.node.ahead import row_copier
from kvpeer.protocol import Codec, Prefetch, PrefetchRefused
from kvpeer.router.ahead import CurveClient, PrefetchSender
from kvpeer.router.policy import EngineSpec
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.types import Key, LookupResult, RequestContext, TransferJob
from tests.net.common import BLOCK_LEN, DEADLINE_S, keys_of, wait_until
from tests.net.localnode import LocalNode
from tests.net.processes import StartNode

ZmqContext = zmq.Context[zmq.Socket[bytes]]
CODEC = Codec()
BLOCKS = 8
STAGING = list(range(48, 64))


def synthetic_keys(tokens: Sequence[int], max_keys: int) -> list[Key]:
    """A stand-in for the engine's hash: token i names synthetic block i."""
    return keys_of(list(tokens[:max_keys]))


def staged(consumer: LocalNode) -> LocalNode:
    pool = consumer.pool
    region = PrimaryRegion(pool.view, pool.num_blocks, pool.block_len, pool.shm_path)
    consumer.node.configure_staging(STAGING, synthetic_keys, row_copier(region), BLOCK_LEN)
    return consumer


def refused(sender: PrefetchSender, counted: list[str]) -> bool:
    """Read the tiers' answers now; True once a refusal was counted."""
    sender.poll_refusals()
    return "refused" in counted


def spec(peer_id: str) -> EngineSpec:
    host, _, port = peer_id.rpartition(":")
    return EngineSpec(peer_id, "http://unused", host, int(port))


def test_a_prefetched_prompt_loads_as_a_copy(serve: StartNode, plane: str) -> None:
    producer = serve(plane=plane)
    with staged(LocalNode(plane, prefetch_from=["127.0.0.1/32"])) as consumer:
        sender = PrefetchSender()
        try:
            sender.connect([spec(consumer.peer_id)])
            assert wait_until(lambda: sender.send(spec(consumer.peer_id), "r1",
                                                  spec(producer.peer_id), list(range(BLOCKS))),
                              DEADLINE_S)  # fmt: skip
            assert wait_until(lambda: consumer.statistics().staged_blocks == BLOCKS, DEADLINE_S)
        finally:
            sender.close()
        context = RequestContext("engine-request", None)  # the router's own leg aside
        node = consumer.node
        node.on_new_request(context)
        wanted = tuple(keys_of(range(BLOCKS)))
        loads_before = consumer.statistics().blocks_loaded
        assert [node.lookup(k, context) for k in wanted] == [LookupResult.HIT] * BLOCKS
        started = time.monotonic()
        node.submit_load(TransferJob(99, wanted, tuple(range(BLOCKS)), context))
        consumer.collect()  # no wait: reported inside submit_load
        assert consumer.results.get(99) is True, "the staged load was not done at once"
        assert time.monotonic() - started < DEADLINE_S
        consumer.assert_blocks(range(BLOCKS), range(BLOCKS))
        node.on_request_finished(context)
        stats = consumer.statistics()
        assert (stats.staged_blocks, stats.staging_free) == (0, len(STAGING))
        assert stats.blocks_loaded == loads_before  # the engine's load moved nothing by wire


def test_a_sender_outside_prefetch_from_is_refused_and_nobody_is_dialled(
    serve: StartNode, zmq_context: ZmqContext
) -> None:
    producer = serve(plane="tcp")
    with staged(LocalNode("tcp", prefetch_from=["10.99.0.0/16"])) as consumer:
        dealer = zmq_context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"not-a-router")
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{consumer.peer_id}")
        prefetch = Prefetch(kv_request_id="r1", source=producer.peer_id,
                            tokens=tuple(range(BLOCKS)))  # fmt: skip
        dealer.send(CODEC.encode(prefetch))
        assert dealer.poll(int(DEADLINE_S * 1000)), "no refusal came back"
        answer = CODEC.decode(dealer.recv())
        assert isinstance(answer, PrefetchRefused)
        assert answer.kv_request_id == "r1"
        assert "127.0.0.1" in answer.reason
        assert "prefetch_from" in answer.reason
        assert not consumer.has_session(producer.peer_id)
        assert consumer.statistics().staged_blocks == 0
        assert consumer.node.counters().ahead["refused"] == 1
        dealer.close()


def prefetch_from_address(
    zmq_context: ZmqContext, consumer: LocalNode, producer_id: str, source_ip: str
) -> PrefetchRefused | None:
    """Send one prefetch from a connection bound to ``source_ip``; the refusal, or None
    if the tier obeyed (it answers only to refuse: None once it staged the blocks)."""
    dealer = zmq_context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, f"router-at-{source_ip}".encode())
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{source_ip}:0;{consumer.peer_id}")
    try:
        dealer.send(CODEC.encode(Prefetch(kv_request_id="r1", source=producer_id,
                                          tokens=tuple(range(BLOCKS)))))  # fmt: skip

        def staged_all() -> bool:
            return consumer.statistics().staged_blocks == BLOCKS

        while not staged_all():
            if dealer.poll(10):
                answer = CODEC.decode(dealer.recv())
                assert isinstance(answer, PrefetchRefused)
                return answer
            assert wait_until(lambda: staged_all() or dealer.poll(0) != 0, DEADLINE_S), (
                consumer.statistics(), consumer.node.counters().ahead)
        return None
    finally:
        dealer.close()


def test_by_default_an_open_node_obeys_its_own_hosts_loopback(
    serve: StartNode, zmq_context: ZmqContext
) -> None:
    """No prefetch_from and no allowed_peers (the README's tier entry): a router on the
    node's host is obeyed with nothing configured."""
    producer = serve(plane="tcp")
    with staged(LocalNode("tcp")) as consumer:
        assert prefetch_from_address(zmq_context, consumer, producer.peer_id, "127.0.0.5") is None
        assert consumer.statistics().staged_blocks == BLOCKS


def test_by_default_an_allow_listed_node_obeys_only_its_allowed_peers(
    serve: StartNode, zmq_context: ZmqContext
) -> None:
    """With an allowed_peers list the routers are the fleet's: a sender outside the list
    is refused by name and nothing is fetched; one inside is obeyed."""
    producer = serve(plane="tcp")
    fleet = ["127.0.0.1/32", "127.0.0.2/32"]
    with staged(LocalNode("tcp", allowed_peers=fleet)) as consumer:
        refusal = prefetch_from_address(zmq_context, consumer, producer.peer_id, "127.0.0.3")
        assert refusal is not None
        assert "127.0.0.3" in refusal.reason
        assert "not allowed" in refusal.reason
        assert not consumer.has_session(producer.peer_id)
        assert consumer.statistics().staged_blocks == 0
        assert prefetch_from_address(zmq_context, consumer, producer.peer_id, "127.0.0.2") is None


def test_an_empty_prefetch_from_turns_pulling_ahead_off(
    serve: StartNode, zmq_context: ZmqContext
) -> None:
    producer = serve(plane="tcp")
    with staged(LocalNode("tcp", prefetch_from=[])) as consumer:
        refusal = prefetch_from_address(zmq_context, consumer, producer.peer_id, "127.0.0.1")
        assert refusal is not None
        assert "not allowed" in refusal.reason
        assert not consumer.has_session(producer.peer_id)


def refused_sender(consumer: LocalNode, producer_id: str) -> tuple[PrefetchSender, list[str]]:
    """A router's sender whose first prefetch to ``consumer`` was refused (counted)."""
    counted: list[str] = []
    sender = PrefetchSender(count=counted.append)
    try:
        sender.connect([spec(consumer.peer_id)])
        assert wait_until(lambda: sender.send(spec(consumer.peer_id), "r1",
                                              spec(producer_id), [1, 2]), DEADLINE_S)
        assert wait_until(lambda: refused(sender, counted), DEADLINE_S)
    except BaseException:
        sender.close()
        raise
    return sender, counted


def test_a_router_stops_prefetching_to_a_tier_that_never_obeys(serve: StartNode) -> None:
    producer = serve(plane="tcp")
    with staged(LocalNode("tcp", prefetch_from=[])) as consumer:
        sender, counted = refused_sender(consumer, producer.peer_id)
        try:
            assert sender.barred(consumer.peer_id)
            sent = counted.count("sent")
            assert not sender.send(spec(consumer.peer_id), "r2", spec(producer.peer_id), [1, 2])
            assert counted.count("sent") == sent  # nothing more goes to it
        finally:
            sender.close()


def test_the_senders_count_refusals(serve: StartNode) -> None:
    producer = serve(plane="tcp")
    with LocalNode("tcp", prefetch_from=["127.0.0.1/32"]) as consumer:  # no staging rows
        sender, _ = refused_sender(consumer, producer.peer_id)
        try:
            (reason,) = sender.refused_reasons(consumer.peer_id)
            assert "stages nothing" in reason
            assert sender.barred(consumer.peer_id)
        finally:
            sender.close()


def curve_keys(root: Path) -> tuple[dict[str, str], CurveClient, CurveClient]:
    """A tier's CURVE config; a router admitted by it; a rogue router that is not."""
    keys, allowed = root / "keys", root / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(keys, "fleet")
    router_public, router_secret = zmq.auth.create_certificates(keys, "router")
    _, rogue_secret = zmq.auth.create_certificates(keys, "rogue")
    shutil.copy(router_public, allowed)
    tier = {"server_secret_key_file": server_secret, "server_public_key_file": server_public,
            "client_public_keys_dir": str(allowed)}  # fmt: skip
    admitted = CurveClient.load(router_secret, server_public)
    rogue = CurveClient.load(rogue_secret, server_public)
    return tier, admitted, rogue


def test_with_curve_only_a_router_whose_key_the_tier_holds_is_read(
    serve: StartNode, tmp_path: Path
) -> None:
    producer = serve(plane="tcp")
    tier, admitted, rogue = curve_keys(tmp_path)
    with LocalNode("tcp", prefetch_from=["127.0.0.1/32"], curve=tier) as consumer:  # no rows
        heard: dict[str, list[str]] = {"admitted": [], "rogue": []}
        senders = {name: PrefetchSender(zmq.Context(), count=heard[name].append, curve=keys)
                   for name, keys in (("admitted", admitted), ("rogue", rogue))}  # fmt: skip
        try:
            for sender in senders.values():
                sender.connect([spec(consumer.peer_id)])
            # the admitted router's prefetch reaches the tier: refused, by name
            assert wait_until(lambda: senders["admitted"].send(
                spec(consumer.peer_id), "r1", spec(producer.peer_id), [1, 2]), DEADLINE_S)
            assert wait_until(lambda: refused(senders["admitted"], heard["admitted"]), DEADLINE_S)
            # the rogue's connection never completes its CURVE handshake: nothing leaves
            for _ in range(20):
                senders["rogue"].send(spec(consumer.peer_id), "r2", spec(producer.peer_id), [1])
                time.sleep(0.01)
            senders["rogue"].poll_refusals()
            assert "sent" not in heard["rogue"]
            assert "refused" not in heard["rogue"]
            assert consumer.node.counters().ahead["prefetches"] == 1
        finally:
            for sender in senders.values():
                sender.close()


def test_a_router_key_file_that_cannot_be_used_is_named(tmp_path: Path) -> None:
    zmq.auth.create_certificates(tmp_path, "router")
    with pytest.raises(ConfigError, match=r"prefetch_curve_key: .* holds no secret key"):
        CurveClient.load(str(tmp_path / "router.key"), str(tmp_path / "router.key"))
    with pytest.raises(ConfigError, match="prefetch_curve_server_key: cannot load"):
        CurveClient.load(str(tmp_path / "router.key_secret"), str(tmp_path / "missing.key"))
