"""kvpeer's vLLM metrics against vLLM's own metric classes (no engine).

vLLM asserts on undeclared names, wrong label counts and non-Python numbers, and
an assertion there kills the engine or the API server. Here the definitions come
from vLLM's own spec lookup (``secondary_tiers`` → ``KVPeerTier.build_metric_definitions``),
the payloads from two real nodes pulling, and every payload crosses a msgpack round
trip like vLLM's IPC before vLLM's ``OffloadPromMetrics.observe`` records it.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
)

from kvpeer.integrations.vllm.metrics import PREFIX, StatsSource
from kvpeer.metrics.catalog import CATALOG
from kvpeer.router.engineload import parse_engine_wait
from tests.net.common import BLOCK_LEN, keys_of
from tests.net.localnode import LocalNode
from tests.net.servingnode import ServingNode

EXTRA_CONFIG = {
    "spec_name": "CpuTieringOffloadingSpec",
    "spec_module_path": "kvpeer.integrations.vllm.cpu_spec",
    "cpu_bytes_to_use": 1 << 24,
    "secondary_tiers": [{"type": "KVPeerTier", "module_path": "kvpeer.integrations.vllm"}],
}
ENGINE_LABELS = {"model_name": "tiny", "engine": "0"}
TYPES = {
    OffloadingCounterMetadata: "counter",
    OffloadingGaugeMetadata: "gauge",
    OffloadingHistogramMetadata: "histogram",
}


def vllm_metrics(registry: CollectorRegistry) -> OffloadPromMetrics:
    config: Any = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=EXTRA_CONFIG)
    )
    kinds: Any = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    return OffloadPromMetrics(config, kinds, list(ENGINE_LABELS), {0: list(ENGINE_LABELS.values())})


def check_and_send(stats: OffloadingConnectorStats, prom: OffloadPromMetrics) -> None:
    """Every sample declared, typed and Python-numbered; then vLLM's IPC and observe."""
    declared = prom._offloading_metric_metadata
    types, data = stats.data["types"], stats.data["data"]
    for name, series in data.items():
        assert name.startswith(PREFIX), name
        metadata = declared[name]
        assert types[name] == TYPES[type(metadata)], name
        for labels, value in series.items():
            assert type(labels) is tuple, name
            assert len(labels) == len(metadata.labelnames), name
            assert all(type(v) is str for v in labels), name
            if types[name] == "histogram":
                assert type(value) is list, name
                assert all(type(v) in (int, float) for v in value), name
            else:
                assert type(value) in (int, float), name
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.data))
    OffloadingConnectorStats(data=wire).reduce()  # vLLM's "KV Transfer metrics" log line
    prom.observe(wire, engine_idx=0)


def test_every_catalog_metric_is_declared_to_vllm() -> None:
    prom = vllm_metrics(CollectorRegistry())
    ours = {n for n in prom._offloading_metric_metadata if n.startswith(PREFIX)}
    assert ours == {PREFIX + m.name for m in CATALOG}


def test_payloads_of_two_pulling_nodes_pass_vllms_checks_and_add_up() -> None:
    registry = CollectorRegistry()
    prom = vllm_metrics(registry)

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(PREFIX + name, {**ENGINE_LABELS, **labels})

    with ServingNode("tcp") as producer, LocalNode("tcp") as consumer:
        source = StatsSource(consumer.node, clock=lambda: 0.0)  # a second never passes
        first = source.take(force=True)
        assert first is not None
        check_and_send(first, prom)
        assert sample("pulled_bytes_total") == 0  # series exist before any event
        assert source.take() is None  # nothing moved, and not a second later

        for start in (0, 8):
            result = consumer.pull(producer.peer_id, keys_of(range(start, start + 8)),
                                   range(start, start + 8))  # fmt: skip
            assert result.loaded
        served = StatsSource(producer.node).take(force=True)
        pulled = source.take()  # within the second, but the counters moved: read now
        assert source.take() is None  # and nothing moved since
        assert served is not None
        assert pulled is not None
        check_and_send(pulled, prom)
        assert sample("pulled_bytes_total") == 16 * BLOCK_LEN
        assert sample("fetches_total", result="ok") == 2
        assert sample("fetch_duration_seconds_count") == 2
        assert sample("fetch_size_bytes_sum") == 16 * BLOCK_LEN
        assert sample("sessions") == 1
        assert served.data["data"][PREFIX + "served_bytes_total"][()] == 16 * BLOCK_LEN

        again = source.take(force=True)  # nothing new: no counter moves twice
        assert again is not None
        check_and_send(again, prom)
        assert sample("pulled_bytes_total") == 16 * BLOCK_LEN
        assert sample("fetch_duration_seconds_count") == 2


@pytest.mark.parametrize(("engine_wait_s", "exported"), [(None, math.inf), (1.5, 1.5)])
def test_the_engine_wait_bound_reaches_vllms_metrics_page_as_the_router_reads_it(
    engine_wait_s: float | None, exported: float
) -> None:
    """``engine_wait_s: null`` is the gauge's ``+Inf``: it crosses vLLM's IPC and its log
    line's reduce, lands on vLLM's registry, and the router's scrape reads it back."""
    registry = CollectorRegistry()
    prom = vllm_metrics(registry)
    with LocalNode("tcp", config={"engine_wait_s": engine_wait_s}) as node:
        stats = StatsSource(node.node).take(force=True)
    assert stats is not None
    check_and_send(stats, prom)
    name = PREFIX + "engine_wait_seconds"
    assert registry.get_sample_value(name, ENGINE_LABELS) == exported
    assert parse_engine_wait(generate_latest(registry).decode()) == {"0": exported}
