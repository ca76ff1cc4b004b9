"""The router's own metrics: ``kvpeer_router_*`` in a private registry (nothing global).

Counters and histograms the edge updates as requests go, and gauges read at scrape
time from the router (engine health, in-flight load) and from the policy's ``stats()``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpeer.router.config import RouterConfig
from kvpeer.router.engineload import EngineLoadFeed
from kvpeer.router.health import EngineHealth
from kvpeer.router.index import PrefixIndex

__all__ = ["LATENCY_BUCKETS", "PREFIX", "LiveCollector", "RouterMetrics", "RouterView"]

log = logging.getLogger(__name__)

PREFIX = "kvpeer_router_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _InFlight(Protocol):
    in_flight: int


class RouterView(Protocol):
    """What the live gauges read from the router at scrape time."""

    config: RouterConfig
    health: EngineHealth
    index: PrefixIndex | None
    engine_load: EngineLoadFeed | None

    @property
    def policy(self) -> object: ...

    def load_of(self, name: str) -> _InFlight: ...


class RouterMetrics:
    """``kvpeer_router_*`` in a private registry (nothing global)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        self.requests = counter("requests", "Client requests by mode and outcome",
                                ["mode", "outcome"])
        self.retries = counter("retries", "Serving legs re-sent to another engine")
        self.fallbacks = counter("fallbacks", "PD prefill legs that failed: decode-only")
        self.prefetches = counter("prefetches", "Prefetches to serving engines' tiers (pulling "
                                  "ahead): sent, dropped (queue full), refused by the tier",
                                  ["outcome"])
        self.upstream_errors = counter("upstream_errors", "Failed engine calls by reason",
                                       ["reason"])
        self.stripped = counter("client_kv_params_stripped",
                                "Client requests that carried routing fields (removed)")
        self.tokenize_failures = counter("tokenize_failures",
                                         "Prompts routed by load because /tokenize failed")
        self.policy_errors = counter("policy_errors", "Plans replaced by load-only", ["kind"])
        self.last_resort = counter("last_resort", "Requests sent to an engine that was down "
                                   "but not known gone, because none was healthy")
        self.restarts = counter("engine_restarts",
                                "Engines seen down then up again, judged restarted (index "
                                "forgotten)")
        self.flaps = counter("engine_flaps", "Engines seen down then up again, judged the "
                             "same process (index kept)")
        self.predicted_cached = counter(
            "predicted_cached_tokens", "Cached prompt tokens the plan predicted "
            "(requests whose engine reported cached_tokens)")
        self.actual_cached = counter("actual_cached_tokens",
                                     "Cached prompt tokens the engine reported")
        self.duration = Histogram(PREFIX + "request_duration_seconds",
                                  "Client request duration", ["mode"],
                                  buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram(PREFIX + "ttft_seconds",
                              "Client request arrival to first byte sent to it", ["mode"],
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.prefill_leg = Histogram(PREFIX + "prefill_leg_seconds",
                                     "PD prefill leg duration (successful legs)",
                                     buckets=LATENCY_BUCKETS, registry=registry)


class LiveCollector(Collector):
    """Gauges read at scrape time: engine health, in-flight load, the policy's own stats."""

    def __init__(self, router: RouterView) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        up = GaugeMetricFamily(PREFIX + "engine_up", "1 if the engine is routable",
                               labels=["engine"])
        flight = GaugeMetricFamily(PREFIX + "in_flight", "Requests sent and not finished",
                                   labels=["engine"])
        for entry in router.config.engines:
            up.add_metric([entry.name], float(router.health.healthy(entry.name)))
            flight.add_metric([entry.name], float(router.load_of(entry.name).in_flight))
        yield up
        yield flight
        feed = router.engine_load
        if feed is not None:
            reported = GaugeMetricFamily(
                PREFIX + "engine_reported_requests", "Running plus waiting requests the "
                "engine last reported on its /metrics (every router's; absent when stale)",
                labels=["engine"])
            for entry in router.config.engines:
                report = feed.report(entry.name)
                if report is not None:
                    reported.add_metric([entry.name], report.running + report.waiting)
            yield reported
            stats = feed.statistics()
            yield CounterMetricFamily(PREFIX + "load_scrapes", "Scrapes of engines' /metrics "
                                      "for their load", value=stats["scrapes_total"])
            yield CounterMetricFamily(PREFIX + "load_scrape_failures", "Scrapes of engines' "
                                      "/metrics that failed", value=stats["scrape_failures_total"])
        health = router.health.statistics()
        yield GaugeMetricFamily(PREFIX + "engines_healthy", "Routable engines",
                                value=float(len(health.up)))
        returns = CounterMetricFamily(
            PREFIX + "engine_returns", "Engines seen down then up again, by the evidence "
            "that decided (witness_new, refused, failures: restarted; witness_same, "
            "none: a flap)", labels=["evidence"])
        for evidence, count in health.verdicts:
            returns.add_metric([evidence], float(count))
        yield returns
        if router.index is not None:
            yield from _index_metrics(router.index)
        families: dict[str, GaugeMetricFamily] = {}
        for key, value in _policy_numbers(router.policy).items():
            # "name", "name:key" or "rate:name[:key]" (e.g. "rate:prefill_s_per_token:a",
            # "plans_by_reason:pd: decode-only, cached"): one family per name, the rest
            # as label "key".
            parts = key.split(":", 2 if key.startswith("rate:") else 1)
            name = "_".join(parts[:-1] if len(parts) > 1 else parts)
            if not name.isidentifier():
                continue
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(
                    PREFIX + "policy_" + name, f"the routing policy's {name}",
                    labels=["key"] if len(parts) > 1 else None,
                )
            family.add_metric([parts[-1]] if len(parts) > 1 else [], value)
        yield from families.values()


def _index_metrics(index: PrefixIndex) -> Iterator[Metric]:
    """What the prefix index holds per engine (its memory: chain keys, hash mappings,
    speculative entries) and its event counters (orphans, unknown removals, ...)."""
    stats = index.statistics(time.monotonic())
    blocks = GaugeMetricFamily(PREFIX + "index_blocks", "Blocks the index holds per engine "
                               "and medium (bounded by what the engine holds)",
                               labels=["engine", "medium"])
    for engine, medium, count in stats.blocks:
        blocks.add_metric([engine, medium], float(count))
    mappings = GaugeMetricFamily(PREFIX + "index_hash_mappings", "Engine block hashes the "
                                 "index maps to chain keys (live and recently removed)",
                                 labels=["engine"])
    for engine, count in stats.hash_mappings:
        mappings.add_metric([engine], float(count))
    speculative = GaugeMetricFamily(PREFIX + "index_speculative", "Live speculative "
                                    "entries (sent, not yet confirmed)", labels=["engine"])
    for engine, count in stats.speculative:
        speculative.add_metric([engine], float(count))
    events = CounterMetricFamily(PREFIX + "index_events", "What the index met applying "
                                 "KV events, by kind", labels=["kind"])
    for kind, count in stats.counts:
        events.add_metric([kind], float(count))
    yield from (blocks, mappings, speculative, events)


def _policy_numbers(policy: object) -> dict[str, float]:
    """Numeric fields of ``policy.stats()`` (or ``statistics()``), if it offers either."""
    method = getattr(policy, "stats", None) or getattr(policy, "statistics", None)
    if not callable(method):
        return {}
    try:
        stats = method()
    except Exception:
        log.exception("policy statistics failed")
        return {}
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        items: Mapping[str, object] = dataclasses.asdict(stats)
    elif isinstance(stats, Mapping):
        items = stats
    else:
        return {}
    return {
        str(k): float(v)
        for k, v in items.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


