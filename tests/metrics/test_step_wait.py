"""``peer_step_wait_seconds``: how long a peer's lookups wait for the engine's serve window."""

from __future__ import annotations

import threading
import time

from kvpeer.host import TieringHost
from kvpeer.lab.pull import PullResult
from kvpeer.metrics import ThreadCpu, read_node, values
from kvpeer.node.counters import HistogramSnapshot
from kvpeer.node.driver import DrivenTier
from tests.net.common import BLOCK_LEN, keys_of
from tests.net.localnode import LocalNode, open_pool_node

HELD_S = 0.3


def step_wait(node: DrivenTier) -> HistogramSnapshot:
    snapshot = values(read_node(node, ThreadCpu()))["peer_step_wait_seconds"][()]
    assert isinstance(snapshot, HistogramSnapshot)
    return snapshot


def test_a_held_engine_step_shows_as_the_peers_wait() -> None:
    pool, producer = open_pool_node("held", "tcp", 64, BLOCK_LEN, "127.0.0.1", 0,
                                    {"engine_wait_s": None}, synthetic=8)  # held past it
    host = TieringHost(pool, [producer])
    try:
        assert step_wait(producer).count == 0
        with LocalNode("tcp") as consumer:
            pulled: list[PullResult] = []
            puller = threading.Thread(
                target=lambda: pulled.append(consumer.pull(producer.tier.peer_id,
                                                           keys_of(range(8)), range(8))),
            )  # fmt: skip
            puller.start()
            # The engine does not step: the consumer's lookup waits at the tier.
            deadline = time.monotonic() + 20
            while not producer.wait_for_work(0.05):
                assert time.monotonic() < deadline, "the peer's lookup never arrived"
            time.sleep(HELD_S)
            while puller.is_alive():
                producer.wait_for_work(0.05)
                host.step()
            puller.join()
            # The consumer served nothing: nothing of it ever waited for its engine.
            assert step_wait(consumer.node).count == 0
        assert pulled[0].loaded
        waited = step_wait(producer)
        assert waited.count >= 1
        assert max(waited.recent) >= HELD_S
        assert waited.total >= HELD_S
        assert waited.recent[0] >= HELD_S  # the first window held the step
    finally:
        host.shutdown()
        pool.close()
