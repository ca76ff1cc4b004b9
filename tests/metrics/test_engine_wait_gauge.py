"""The tier's ``engine_wait_seconds``: its ``engine_wait_s`` on ``/metrics`` (+Inf for null,
no bound)."""

from __future__ import annotations

import math

import pytest

from kvpeer.metrics import ThreadCpu, values
from kvpeer.metrics.reading import read_tier
from kvpeer.testing.cluster import Cluster, TierNode

CASES = [({}, 0.25), ({"engine_wait_s": 1.5}, 1.5), ({"engine_wait_s": 0}, 0.0),
         ({"engine_wait_s": None}, math.inf)]  # fmt: skip


def producer(config: dict[str, object]) -> TierNode:
    cluster = Cluster()
    node = cluster.add("b", 2, config)
    cluster.run()
    return node


@pytest.mark.parametrize(("config", "exported"), CASES)
def test_the_tier_exports_its_engine_wait(config: dict[str, object], exported: float) -> None:
    node = producer(config)
    assert values(read_tier(node.tier, ThreadCpu()))["engine_wait_seconds"] == {(): exported}

