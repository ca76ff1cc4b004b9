"""kvpeer's metrics catalog through vLLM's secondary-tier metric hooks.

vLLM 0.32 asks a tier class for ``build_metric_definitions`` (names, types, labels,
buckets) and an instance for ``get_stats`` every scheduler step; what ``get_stats``
returns crosses vLLM's IPC as msgpack and lands on the API server's ``/metrics``
with vLLM's ``model_name``/``engine`` labels, as ``vllm:kvpeer_<name>``.

Invariants (vLLM asserts on each, and an assertion there kills the engine or the
API server):

1. Every name emitted is declared, with its declared type; label values are
   tuples of ``str`` of the declared length; numbers are Python ``int``/``float``.
2. Counters are emitted as increments since the last emission (vLLM adds them),
   gauges as values, histograms as the raw observations since the last emission.
3. The node is read when its counters moved (a lock-free ``Tier.activity()`` check)
   or every :data:`READ_EVERY_S` for gauges (``get_stats`` runs on every step; a
   reading takes the node's lock): a pull counted in a request's last step reaches
   ``/metrics`` with that step, not with some later request's. The first reading
   emits every series, zeros included, so they exist from the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvpeer.metrics.catalog import CATALOG, MetricType
from kvpeer.metrics.reading import ThreadCpu, Value, read_node, values
from kvpeer.node.counters import HistogramSnapshot
from kvpeer.node.driver import DrivenTier

__all__ = ["PREFIX", "READ_EVERY_S", "StatsSource", "metric_definitions"]

PREFIX = "vllm:kvpeer_"
READ_EVERY_S = 1.0


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The catalog as vLLM metric metadata (``vllm:kvpeer_*``)."""
    out: dict[str, OffloadingMetricMetadata] = {}
    for metric in CATALOG:
        name = PREFIX + metric.name
        if metric.type is MetricType.COUNTER:
            out[name] = OffloadingCounterMetadata(metric.help, metric.labels)
        elif metric.type is MetricType.GAUGE:
            out[name] = OffloadingGaugeMetadata(metric.help, metric.labels)
        else:
            out[name] = OffloadingHistogramMetadata(metric.help, metric.labels, metric.buckets)
    return out


class StatsSource:
    """Turns readings of one node into vLLM stats payloads (invariants 2 and 3)."""

    def __init__(self, node: DrivenTier, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._node = node
        self._clock = clock
        self._cpu = ThreadCpu()
        self._next_read = 0.0
        self._activity = -1
        self._last: dict[str, dict[tuple[str, ...], Value]] | None = None

    def take(self, *, force: bool = False) -> OffloadingConnectorStats | None:
        now = self._clock()
        activity = self._node.tier.activity()
        if not force and now < self._next_read and activity == self._activity:
            return None
        self._next_read = now + READ_EVERY_S
        self._activity = activity
        current = values(read_node(self._node, self._cpu))
        last, self._last = self._last, current
        stats = OffloadingConnectorStats()
        for metric in CATALOG:
            name = PREFIX + metric.name
            before = last[metric.name] if last is not None else {}
            for labels, value in current[metric.name].items():
                if isinstance(value, HistogramSnapshot):
                    for sample in _new_observations(value, before.get(labels)):
                        stats.observe_histogram(name, float(sample), labels)
                elif metric.type is MetricType.GAUGE:
                    stats.set_gauge(name, float(value), labels)
                else:
                    previous = before.get(labels, 0.0)
                    assert not isinstance(previous, HistogramSnapshot)
                    delta = float(value) - float(previous)
                    if last is None or delta > 0:
                        stats.increase_counter(name, max(delta, 0.0), labels)
        return stats


def _new_observations(now: HistogramSnapshot, before: Any) -> tuple[float, ...]:
    seen = before.count if isinstance(before, HistogramSnapshot) else 0
    new = now.count - seen
    if new <= 0:
        return ()
    return now.recent[-new:] if new <= len(now.recent) else now.recent
