"""Peers that die, freeze, restart, stay silent or never produce, over real sockets.

Every failure must end as failed jobs (or MISS answers) within its deadline, never a
hang, and the consumer must go on working with other peers. Both sides run
heartbeats of 0.2 s / 1 s here, so a frozen peer is declared dead in about a second.
"""

from __future__ import annotations

import glob
import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import zmq

from kvpeer.node.peertable import FIRST_RETRY_S
from kvpeer.protocol import (
    Connect,
    ConnectAck,
    Fetch,
    Lookup,
    LookupResponse,
)
from kvpeer.types import LookupResult
from tests.net.common import free_port, keys_of, plane_params, wait_until
from tests.net.localnode import LocalNode, PdLoad
from tests.net.processes import NodeProcess, StartNode, start_serve
from tests.net.rawpeer import RawPeer, SilentListener
from tests.net.servingnode import ServingNode

HEARTBEATS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}
HEARTBEAT_TIMEOUT_S = 1.0
#: Scheduling slack on a loaded 2-core machine (driver ticks, process wake-ups).
SLACK_S = 2.0
PEER_WAIT_S = 1.5  # the default


@pytest.fixture(scope="module")
def other_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A healthy tcp peer serving synthetic blocks 0..63, for "the others still work"."""
    server = start_serve(tmp_path_factory.mktemp("other"), plane="tcp", config=HEARTBEATS)
    try:
        yield server
    finally:
        server.stop()


def assert_pull_works(consumer: LocalNode, peer_id: str, slots: range = range(48, 64)) -> None:
    indexes = list(range(len(slots)))
    result = consumer.pull(peer_id, keys_of(indexes), slots)
    assert (result.hits, result.loaded) == (len(slots), True)
    consumer.assert_blocks(slots, indexes)


def start_slow_pd_loads(
    consumer: LocalNode, prefill: NodeProcess, ids: list[str], count: int
) -> list[PdLoad]:
    """One PD load per id into its own slots; returns once the first blocks of every load
    landed, i.e. with every load in the middle of its transfer."""
    loads = [
        consumer.start_pd_load(
            prefill.peer_id, kv_request_id, keys_of(range(count)), range(n * count, (n + 1) * count)
        )
        for n, kv_request_id in enumerate(ids)
    ]
    landed = wait_until(lambda: all(consumer.block_index(n * count) == 0 for n in range(len(ids))))
    assert landed, f"setup: the first blocks never arrived\n{prefill.log()}"
    assert consumer.statistics().loads_in_flight == len(ids)
    return loads


def slow_producer(producer: StartNode, plane: str, ids: list[str], **kwargs: object) -> NodeProcess:
    """A producer whose stores trickle in over ~3.5 s: its transfers are long."""
    return producer(
        kv_request_ids=ids,
        count=32,
        plane=plane,
        batches=8,
        interval_s=0.5,
        config=HEARTBEATS,
        wait=False,
        **kwargs,
    )


# -- a peer dies or freezes mid-transfer ------------------------------------------------------


@pytest.mark.parametrize("plane", plane_params())
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_peer_lost_mid_transfer_fails_its_loads_within_the_heartbeat_timeout(
    producer: StartNode, other_peer: NodeProcess, plane: str, how: str
) -> None:
    """SIGKILL: the kernel closes the peer's sockets. SIGSTOP: its sockets stay open and
    only heartbeats can tell; load_timeout_s (30 s) must not be what ends the loads."""
    ids = [f"kill-a-{uuid.uuid4().hex}", f"kill-b-{uuid.uuid4().hex}"]
    prefill = slow_producer(producer, plane, ids)
    planes = [plane] if plane == "tcp" else [plane, "tcp"]  # tcp: to pull from other_peer
    with LocalNode(planes, config=HEARTBEATS) as consumer:
        prefill.wait_ready()
        loads = start_slow_pd_loads(consumer, prefill, ids, 32)

        prefill.signal(getattr(signal, how))
        lost_at = time.monotonic()
        outcomes = [load.wait() for load in loads]
        elapsed = time.monotonic() - lost_at

        assert outcomes == [False, False], "a lost peer's loads must fail, not hang"
        assert elapsed <= HEARTBEAT_TIMEOUT_S + SLACK_S, f"took {elapsed:.2f}s"
        stats = consumer.statistics()
        assert (stats.loads_in_flight, stats.sessions) == (0, 0), stats
        # Invariant: requests of the dead peer compute locally until they finish.
        assert consumer.node.lookup(keys_of([0])[0], loads[0].context) is LookupResult.MISS
        for load in loads:
            load.finish()
        assert consumer.statistics().failed_ids == 0

        assert_pull_works(consumer, other_peer.peer_id)
        assert not consumer.node.crashed
    prefill.kill()


def test_peer_restarted_at_the_same_port_gets_a_fresh_session(
    producer: StartNode, serve: StartNode
) -> None:
    port = free_port()
    old_id = f"restart-{uuid.uuid4().hex}"
    prefill = slow_producer(producer, "tcp", [old_id], port=port)
    with LocalNode("tcp", config=HEARTBEATS) as consumer:
        prefill.wait_ready()
        (old_load,) = start_slow_pd_loads(consumer, prefill, [old_id], 32)

        prefill.kill()
        restarted = serve(plane="tcp", port=port, config=HEARTBEATS)  # a new boot id

        assert restarted.peer_id == prefill.peer_id
        assert old_load.wait() is False, "the old incarnation's load must fail"
        old_load.finish()
        assert_pull_works(consumer, restarted.peer_id, range(32, 64))
        assert consumer.statistics().sessions == 1


def test_lookups_toward_a_frozen_peer_answer_miss_after_the_heartbeat_timeout(
    serve: StartNode,
) -> None:
    server = serve(plane="tcp", config=HEARTBEATS, wait=False)
    with LocalNode("tcp", config=HEARTBEATS) as consumer:  # lookup_timeout_s stays 30 s
        server.wait_ready()
        assert_pull_works(consumer, server.peer_id)  # a ready session

        server.signal(signal.SIGSTOP)
        started = time.monotonic()
        result = consumer.pull(server.peer_id, keys_of(range(16)), range(16, 32))
        elapsed = time.monotonic() - started

        assert (result.hits, result.loaded) == (0, False)
        assert elapsed <= HEARTBEAT_TIMEOUT_S + SLACK_S, f"lookups took {elapsed:.2f}s"
    server.kill()


def test_a_peer_frozen_in_session_is_given_up_after_peer_wait_s_not_the_heartbeat(
    serve: StartNode,
) -> None:
    """Default heartbeats (10 s) on both sides: the consumer's pings go unanswered, so
    its lookups answer MISS after peer_wait_s (1.5 s by default), and the peer is used
    again once it runs (issue 11: a request's budget, not the heartbeat)."""
    server = serve(plane="tcp", wait=False)
    with LocalNode("tcp") as consumer:
        server.wait_ready()
        assert_pull_works(consumer, server.peer_id)  # a ready session
        server.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            result = consumer.pull(server.peer_id, keys_of(range(16)), range(16, 32))
            elapsed = time.monotonic() - started
        finally:
            server.signal(signal.SIGCONT)
        assert (result.hits, result.loaded) == (0, False)
        assert elapsed <= PEER_WAIT_S + SLACK_S, f"lookups took {elapsed:.2f}s"
        assert consumer.statistics().sessions_ended.get("unreachable") == 1
        assert wait_until(
            lambda: consumer.pull(server.peer_id, keys_of(range(16)), range(16, 32)).loaded,
            timeout_s=30.0,
        )
    server.kill()


STALL_TIMEOUTS = {
    "load_timeout_s": 0.5,
    "abort_ack_timeout_s": 0.5,
    "abort_drain_timeout_s": 0.5,
    "store_timeout_s": 0.5,
}


@pytest.mark.parametrize("then", ["goes away", "stays and never reads"])
def test_a_stalled_transfer_does_not_hold_the_producers_pins_forever(
    zmq_context: zmq.Context[zmq.Socket[bytes]], then: str
) -> None:
    """A consumer fetches, then its data stream stalls (the transfer cannot finish).
    If it goes away, the producer cancels the transfer and unpins at once. If it stays
    (its control channel heartbeats) and never aborts, the producer must still give up
    once no honest consumer can be waiting: after load_timeout_s + abort_ack_timeout_s
    (+ abort_drain_timeout_s). Otherwise any peer can pin a producer's blocks forever."""
    block_len, count = 256 * 1024, 64  # 16 MiB: more than the socket buffers hold
    sink = SilentListener()  # the consumer's data port: accepts, never reads
    node = ServingNode("tcp", block_len=block_len, config={**HEARTBEATS, **STALL_TIMEOUTS})
    consumer = RawPeer(zmq_context, node.peer_id)
    try:
        consumer.send(consumer.hello(block_len=block_len, data_port=sink.port))
        assert consumer.wait_for(Connect) is not None
        consumer.send(consumer.ack())
        assert consumer.wait_for(ConnectAck) is not None
        keys = tuple(keys_of(range(count)))
        consumer.send(Lookup(kv_request_id="stalled", keys=keys, round_seq=0))
        answer = consumer.wait_for(LookupResponse)
        assert answer is not None
        assert all(answer.hits)
        consumer.send(
            Fetch(
                kv_request_id="stalled", keys=keys, block_indexes=tuple(range(count)), round_seq=0
            )
        )
        assert wait_until(lambda: node.statistics().transfers_in_flight > 0)
        assert node.pool.statistics().pinned == count  # what the transfer reads stays pinned
        stalled_at = time.monotonic()
        if then == "goes away":
            consumer.close()
            bound = HEARTBEAT_TIMEOUT_S + SLACK_S
        else:
            bound = sum(STALL_TIMEOUTS[k] for k in ("load_timeout_s", "abort_ack_timeout_s"))
            bound += STALL_TIMEOUTS["abort_drain_timeout_s"] + SLACK_S

        def released() -> bool:
            transfers = node.statistics().transfers_in_flight
            return transfers == 0 and node.pool.statistics().pinned == 0  # ints: safe to read

        assert wait_until(released, timeout_s=bound), (
            f"{node.pool.statistics().pinned} blocks still pinned "
            f"{time.monotonic() - stalled_at:.1f}s after the stall"
        )
        with LocalNode("tcp", block_len=block_len) as legit:
            assert_pull_works(legit, node.peer_id)
    finally:
        consumer.close()
        node.close()
        sink.close()


# -- peers that never answer ------------------------------------------------------------------


@pytest.fixture
def silent_peer() -> Iterator[str]:
    """A plain TCP listener that accepts connections and never sends a byte."""
    listener = SilentListener()
    try:
        yield f"127.0.0.1:{listener.port}"
    finally:
        listener.close()


def given_up(node: LocalNode) -> int:
    """Sessions ``node`` ended because the peer could not be reached or never acked."""
    ended = node.statistics().sessions_ended
    return ended.get("unreachable", 0) + ended.get("timeout", 0)


@pytest.mark.parametrize("kind", ["silent listener", "closed port"])
def test_unresponsive_peer_resolves_to_local_compute(
    silent_peer: str, other_peer: NodeProcess, kind: str
) -> None:
    peer_id = silent_peer if kind == "silent listener" else f"127.0.0.1:{free_port()}"
    with LocalNode("tcp", handshake_timeout_s=1.0, lookup_timeout_s=1.0) as consumer:
        started = time.monotonic()
        result = consumer.pull(peer_id, keys_of(range(8)), range(8))
        pulled_in = time.monotonic() - started

        assert (result.hits, result.loaded) == (0, False)
        assert pulled_in <= 1.0 + SLACK_S, f"lookups took {pulled_in:.2f}s"
        assert all(consumer.is_zero(slot) for slot in range(8))

        assert wait_until(lambda: not consumer.has_session(peer_id))
        # Backed off (it never answered): the next request computes at once...
        at_once = consumer.start_pd_load(
            peer_id, f"pd-{uuid.uuid4().hex}", keys_of(range(8)), range(8)
        )
        at_once.finish()
        assert not at_once.submitted
        assert set(at_once.answers) == {LookupResult.MISS}
        # ...and once the back-off passed, a request tries again and fails in time:
        # its load fails, or (a refused connect is seen within milliseconds, often
        # before the engine's lookups) its lookups already answer MISS.
        unreachable = given_up(consumer)
        time.sleep(FIRST_RETRY_S)  # the back-off is wall-clock time: wait it out
        load = consumer.start_pd_load(
            peer_id, f"pd-{uuid.uuid4().hex}", keys_of(range(8)), range(8)
        )
        try:
            if load.submitted:
                assert load.wait() is False
            else:
                assert set(load.answers) == {LookupResult.MISS}
            assert time.monotonic() - load.submitted_at <= 1.0 + SLACK_S
        finally:
            load.finish()
        assert wait_until(lambda: not consumer.has_session(peer_id))
        # It was a new attempt, not the back-off still answering.
        assert given_up(consumer) > unreachable

        assert_pull_works(consumer, other_peer.peer_id)
        assert not consumer.node.crashed


def test_peer_that_handshakes_then_ignores_lookups(
    zmq_context: zmq.Context[zmq.Socket[bytes]], other_peer: NodeProcess
) -> None:
    """Heartbeats keep this peer alive; only lookup_timeout_s ends the probes."""
    with LocalNode("tcp", lookup_timeout_s=1.0) as consumer:
        mute = RawPeer(zmq_context, consumer.peer_id)
        try:
            mute.send(mute.hello())
            assert mute.wait_for(Connect) is not None, "the consumer did not dial back"
            mute.send(mute.ack())
            assert mute.wait_for(ConnectAck) is not None

            started = time.monotonic()
            result = consumer.pull(mute.peer_id, keys_of(range(8)), range(8))
            pulled_in = time.monotonic() - started

            assert (result.hits, result.loaded) == (0, False)
            assert 0.9 <= pulled_in <= 1.0 + SLACK_S, f"lookups took {pulled_in:.2f}s"
            assert mute.wait_for(Lookup) is not None, "the consumer never asked"
        finally:
            mute.close()
        assert_pull_works(consumer, other_peer.peer_id)


# -- a live producer that cannot deliver ------------------------------------------------------


def test_pd_load_that_times_out_is_aborted_and_acknowledged(producer: StartNode) -> None:
    prefill = producer(kv_request_ids=["someone-else"], count=4, wait=False)
    with LocalNode("tcp", load_timeout_s=1.0, abort_ack_timeout_s=5.0) as consumer:
        prefill.wait_ready()
        load = consumer.start_pd_load(
            prefill.peer_id, f"never-{uuid.uuid4().hex}", keys_of(range(4)), range(4)
        )
        try:
            assert load.wait() is False
            failed_in = time.monotonic() - load.submitted_at
        finally:
            load.finish()

        # After load_timeout_s, and well before abort_ack_timeout_s: the producer acked.
        assert 1.0 <= failed_in <= 1.0 + SLACK_S, f"failed after {failed_in:.2f}s"
        assert consumer.has_session(prefill.peer_id), "an abort must not end the session"
        assert all(consumer.is_zero(slot) for slot in range(4))


def test_late_fetch_for_reaped_stores_is_rejected_at_once(producer: StartNode) -> None:
    kv_request_id = f"late-{uuid.uuid4().hex}"
    prefill = producer(
        kv_request_ids=[kv_request_id],
        count=8,
        config={"unbound_store_timeout_s": 0.3},
        wait=False,
    )
    with LocalNode("tcp") as consumer:
        prefill.wait_ready()
        reaped = wait_until(lambda: "no fetch for" in prefill.log())
        assert reaped, f"setup: the producer never reaped its stores\n{prefill.log()}"

        load = consumer.start_pd_load(prefill.peer_id, kv_request_id, keys_of(range(8)), range(8))
        try:
            assert load.wait() is False
            rejected_in = time.monotonic() - load.submitted_at
        finally:
            load.finish()

        assert rejected_in <= SLACK_S, f"rejected after {rejected_in:.2f}s, not at once"
        assert all(consumer.is_zero(slot) for slot in range(8))


def test_a_refused_peer_costs_a_request_milliseconds_and_is_used_again_once_it_is_back(
    serve: StartNode,
) -> None:
    """Nothing listens: the PD load fails as soon as the connection is refused (not
    after ``handshake_timeout_s``); while backed off, requests compute at once; a
    node started at that address later is used again after the back-off."""
    port = free_port()
    peer_id = f"127.0.0.1:{port}"
    with LocalNode("tcp") as consumer:
        pd_id = f"pd-{uuid.uuid4().hex}"
        started = time.monotonic()
        load = consumer.start_pd_load(peer_id, pd_id, keys_of(range(8)), range(8))
        try:
            # The refusal may even be seen before the lookups: then they answer MISS
            # and the engine computes without submitting a load at all.
            if load.submitted:
                assert load.wait() is False
            else:
                assert set(load.answers) == {LookupResult.MISS}
            took = time.monotonic() - started
        finally:
            load.finish()
        assert took <= 0.25 + SLACK_S / 2, f"a refused connection cost the load {took:.2f}s"
        assert consumer.statistics().sessions_ended.get("unreachable") == 1

        back = serve(plane="tcp", port=port)
        assert back.peer_id == peer_id
        assert wait_until(lambda: (consumer.pull(peer_id, keys_of(range(8)), range(8)).loaded))
        assert_pull_works(consumer, peer_id, range(48, 64))


def test_the_region_file_of_a_killed_node_is_removed_by_the_next_node(serve: StartNode) -> None:
    """SIGKILL leaves nothing to clean up with; the next node started on the machine
    removes the files its claim names (kvpeer.host.claims)."""
    victim = serve(plane="shm")
    left = glob.glob(f"/dev/shm/kvpeer-serve-{victim.pid}-*")
    assert len(left) == 1
    victim.kill()
    assert os.path.exists(left[0]), "setup: SIGKILL should leave the file behind"
    with LocalNode("tcp"):  # any node: it sweeps when it opens
        assert not os.path.exists(left[0])
    assert not glob.glob(f"/dev/shm/kvpeer-claim-kvpeer-serve-{victim.pid}-*")
