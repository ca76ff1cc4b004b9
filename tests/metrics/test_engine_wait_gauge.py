"""The tier's ``engine_wait_seconds``: its ``engine_wait_s`` on ``/metrics`` (+Inf for null,
no bound), rendered as Prometheus text the way the router reads it back
(kvpeer.router.engineload rule 6), so no operator has to tell the router each tier's bound."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvpeer.metrics import ThreadCpu, values
from kvpeer.metrics.prom import NodeCollector
from kvpeer.metrics.reading import NodeReading, read_tier
from kvpeer.router.engineload import parse_engine_wait
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


@pytest.mark.parametrize(("config", "exported"), CASES)
def test_the_router_reads_what_the_tier_renders_as_vllm_does(
    config: dict[str, object], exported: float
) -> None:
    """The same series under vLLM's ``vllm:kvpeer_`` prefix, as Prometheus text (null is
    written ``+Inf``), parsed by the router's scrape."""
    node = producer(config)

    def read(cpu: ThreadCpu) -> NodeReading:
        return read_tier(node.tier, cpu)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(read, prefix="vllm:kvpeer_"))
    page = generate_latest(registry).decode()
    if exported == math.inf:
        assert "vllm:kvpeer_engine_wait_seconds +Inf" in page
    assert parse_engine_wait(page) == {"": exported}
