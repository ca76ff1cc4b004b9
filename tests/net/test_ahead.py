"""Pulling ahead between real nodes over real ZMQ (kvpeer.node.ahead, kvpeer.router.ahead):
the router's prefetch sender asks a consumer node to fetch a producer's blocks into its
staging rows, on every data plane; the engine's lookup then answers HIT with no peer
asked and its load is a copy of the right bytes. A sender whose address is not in
``prefetch_from`` gets a named refusal and the node dials nobody."""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq

from kvpeer.node.ahead import row_copier
from kvpeer.protocol import Codec, Prefetch, PrefetchRefused
from kvpeer.router.ahead import PrefetchSender
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


def test_the_senders_count_refusals(serve: StartNode) -> None:
    producer = serve(plane="tcp")
    with LocalNode("tcp", prefetch_from=["127.0.0.1/32"]) as consumer:  # no staging rows
        counted: list[str] = []
        sender = PrefetchSender(count=counted.append)
        try:
            sender.connect([spec(consumer.peer_id)])
            assert wait_until(lambda: sender.send(spec(consumer.peer_id), "r1",
                                                  spec(producer.peer_id), [1, 2]), DEADLINE_S)
            assert wait_until(lambda: (sender.poll_refusals(), "refused" in counted)[1],
                              DEADLINE_S)  # fmt: skip
            (reason,) = sender.refused_reasons(consumer.peer_id)
            assert "stages nothing" in reason
        finally:
            sender.close()
