"""Two processes over loopback: symmetric pulls and PD loads, byte-exact, on every plane.

The producer is a real subprocess (``kvpeer serve`` with synthetic blocks, or the PD
producer program of ``producer.py``); the consumer is a node in the test process driven
the way an engine drives it. Blocks land in permuted slots so an index mix-up shows.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpeer.lab.pull import PullResult
from kvpeer.node.synthetic import synthetic_key
from kvpeer.types import LookupResult
from tests.net.common import DEADLINE_S, cpu_seconds, keys_of, plane_params, wait_until
from tests.net.localnode import LocalNode
from tests.net.processes import NodeProcess, StartNode, start_serve

COUNT = 64


def permuted(count: int) -> list[int]:
    """Slot of block i: a fixed permutation of 0..count-1 (37 is coprime to 64)."""
    return [(i * 37 + 11) % count for i in range(count)]


class Pair:
    """A ``kvpeer serve`` with synthetic blocks and a consumer node, for one plane."""

    def __init__(self, plane: str, workdir: Path) -> None:
        self.plane = plane
        self.server = start_serve(workdir, plane=plane, synthetic=COUNT, wait=False)
        try:
            self._consumer = LocalNode(plane)
            self.server.wait_ready()
        except BaseException:
            self.server.stop()
            raise

    def consumer(self) -> LocalNode:
        """The consumer, its region zeroed."""
        self._consumer.pool.view[:] = bytes(self._consumer.pool.view.nbytes)
        return self._consumer

    def close(self) -> None:
        try:
            self._consumer.close()
        finally:
            self.server.stop()


@pytest.fixture(scope="module", params=plane_params())
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """Module-scoped and parametrized, so pytest runs each plane's tests together and
    keeps one plane's nodes at a time (an idle NIXL node is not free, see below)."""
    pair = Pair(request.param, tmp_path_factory.mktemp(request.param))
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture(scope="module")
def tcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    server = start_serve(tmp_path_factory.mktemp("tcp"), plane="tcp", synthetic=COUNT)
    try:
        yield server
    finally:
        server.stop()


# -- symmetric ------------------------------------------------------------------------------


def test_symmetric_pull_is_byte_exact(pair: Pair) -> None:
    server, consumer = pair.server, pair.consumer()
    slots = permuted(COUNT)

    result = consumer.pull(server.peer_id, keys_of(range(COUNT)), slots)

    assert (result.hits, result.loaded) == (COUNT, True)
    consumer.assert_blocks(slots, range(COUNT))


def test_symmetric_pull_loads_only_the_leading_hits(pair: Pair) -> None:
    server, consumer = pair.server, pair.consumer()
    keys = [*keys_of(range(10)), synthetic_key(10_000), *keys_of(range(10, 20))]
    slots = list(range(40, 61))

    result = consumer.pull(server.peer_id, keys, slots)

    assert (result.hits, result.loaded) == (10, True)
    consumer.assert_blocks(slots[:10], range(10))
    assert all(consumer.is_zero(slot) for slot in slots[10:]), "a non-hit was written"


def test_pull_of_unknown_keys_misses_and_writes_nothing(tcp_server: NodeProcess) -> None:
    with LocalNode("tcp") as consumer:
        keys = [synthetic_key(5000 + i) for i in range(8)]

        result = consumer.pull(tcp_server.peer_id, keys, range(8))

        assert (result.hits, result.loaded) == (0, False)
        assert all(consumer.is_zero(slot) for slot in range(COUNT))


def test_repeated_pulls_reuse_one_session(tcp_server: NodeProcess) -> None:
    with LocalNode("tcp") as consumer:
        _pull_four_times(consumer, tcp_server.peer_id)
        stats = consumer.statistics()
        assert stats.sessions == 1
        assert (stats.loads_in_flight, stats.requests, stats.consumer_ids) == (0, 0, 0)


def _pull_four_times(consumer: LocalNode, peer_id: str) -> None:
    for first in range(0, COUNT, 16):
        indexes = list(range(first, first + 16))
        slots = [COUNT - 1 - i for i in indexes]

        result = consumer.pull(peer_id, keys_of(indexes), slots)

        assert (result.hits, result.loaded) == (16, True)
        consumer.assert_blocks(slots, indexes)


def test_two_consumers_pull_from_one_producer_at_once(tcp_server: NodeProcess) -> None:
    server = tcp_server
    results: dict[int, PullResult] = {}
    with LocalNode("tcp") as first, LocalNode("tcp") as second:
        consumers = [first, second]

        def pull(number: int) -> None:
            slots = permuted(COUNT) if number else list(range(COUNT))
            results[number] = consumers[number].pull(server.peer_id, keys_of(range(COUNT)), slots)

        threads = [threading.Thread(target=pull, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE_S)
        assert not any(thread.is_alive() for thread in threads)

        assert [(r.hits, r.loaded) for _, r in sorted(results.items())] == [(COUNT, True)] * 2
        first.assert_blocks(range(COUNT), range(COUNT))
        second.assert_blocks(permuted(COUNT), range(COUNT))


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_symmetric_pull_over_ipv6(serve: StartNode, plane: str) -> None:
    server = serve(plane=plane, host="::1", synthetic=16, wait=False)
    with LocalNode(plane, host="::1") as consumer:
        peer_id = server.wait_ready()
        assert peer_id.startswith("[::1]:")

        result = consumer.pull(peer_id, keys_of(range(16)), permuted(16))

        assert (result.hits, result.loaded) == (16, True)
        consumer.assert_blocks(permuted(16), range(16))


# -- idle cost -------------------------------------------------------------------------------

MAX_IDLE_CORES = 0.15


def test_an_idle_node_does_not_spin(pair: Pair) -> None:
    """A node with no work sleeps in its driver's poll: it must not burn a core.

    An engine shares the host's cores with its node; a data plane that spins while
    idle takes them from the engine (and from every other test here). This holds for
    nixl too: NIXL's progress thread, which busy-polls by default, waits for events
    (kvpeer.transport.data.nixl, invariant 8)."""
    pid = pair.server.pid
    before, started = cpu_seconds(pid), time.monotonic()
    wait_until(lambda: False, timeout_s=0.5)  # a measurement window, not a race
    used = (cpu_seconds(pid) - before) / (time.monotonic() - started)

    assert used < MAX_IDLE_CORES, f"an idle {pair.plane} node used {used:.0%} of a core"


# -- PD ------------------------------------------------------------------------------------


def test_pd_load_is_byte_exact(pair: Pair, producer: StartNode) -> None:
    kv_request_id = f"pd-{uuid.uuid4().hex}"
    prefill = producer(kv_request_ids=[kv_request_id], count=COUNT, plane=pair.plane)
    consumer = pair.consumer()
    assert prefill.wait_for_output("stored all")
    slots = permuted(COUNT)

    load = consumer.start_pd_load(prefill.peer_id, kv_request_id, keys_of(range(COUNT)), slots)
    try:
        assert load.answers == [LookupResult.HIT] * COUNT
        assert load.wait() is True
    finally:
        load.finish()
    consumer.assert_blocks(slots, range(COUNT))


def test_pd_fetch_may_arrive_before_the_stores(pair: Pair, producer: StartNode) -> None:
    kv_request_id = f"pd-early-{uuid.uuid4().hex}"
    prefill = producer(
        kv_request_ids=[kv_request_id], count=COUNT, plane=pair.plane, batches=4, delay_s=1.0
    )
    consumer = pair.consumer()

    load = consumer.start_pd_load(
        prefill.peer_id, kv_request_id, keys_of(range(COUNT)), range(COUNT)
    )
    try:
        assert "stored batch" not in prefill.log(), "setup: the stores came first"
        assert load.wait() is True
    finally:
        load.finish()
    consumer.assert_blocks(range(COUNT), range(COUNT))


def test_pd_warm_producer_serves_two_requests_of_the_same_blocks(producer: StartNode) -> None:
    ids = [f"pd-warm-a-{uuid.uuid4().hex}", f"pd-warm-b-{uuid.uuid4().hex}"]
    prefill = producer(kv_request_ids=ids, count=32, plane="tcp", wait=False)
    with LocalNode("tcp") as consumer:
        prefill.wait_ready()
        assert prefill.wait_for_output("stored all")

        loads = [
            consumer.start_pd_load(prefill.peer_id, ids[0], keys_of(range(32)), range(32)),
            consumer.start_pd_load(prefill.peer_id, ids[1], keys_of(range(32)), range(32, 64)),
        ]
        try:
            assert [load.wait() for load in loads] == [True, True]
        finally:
            for load in loads:
                load.finish()
        consumer.assert_blocks(range(64), [*range(32), *range(32)])


@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_pd_load_of_big_blocks(producer: StartNode, plane: str) -> None:
    block_len, count = 2 << 20, 8
    kv_request_id = f"pd-big-{uuid.uuid4().hex}"
    prefill = producer(
        kv_request_ids=[kv_request_id],
        count=count,
        plane=plane,
        block_len=block_len,
        batches=2,
        wait=False,
    )
    with LocalNode(plane, num_blocks=count, block_len=block_len) as consumer:
        prefill.wait_ready()
        slots = permuted(count)
        load = consumer.start_pd_load(prefill.peer_id, kv_request_id, keys_of(range(count)), slots)
        try:
            assert load.wait() is True
        finally:
            load.finish()
        consumer.assert_blocks(slots, range(count))
