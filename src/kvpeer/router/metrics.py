"""The router's own metrics: ``kvpeer_router_*`` in a private registry (nothing global).

Invariants:

1. Every family is declared once, in :data:`FAMILIES` (name, type, labels, meaning);
   the edge's counters and histograms and the gauges read at scrape time are built
   from it, docs/metrics.md's router table is generated from it
   (:func:`markdown_table`), and a test checks that a router exports exactly these.
2. Prometheus conventions: counters are counters and end in ``_total``, durations are
   seconds (``_seconds``), every label names what it holds (``engine``, ``reason``,
   ``source``; never a generic ``key``). Label values are engine names from the
   router's config and fixed words, never a request, a prompt or an address.
3. Counters and histograms are updated by the edge as requests go; gauges and the
   counters kept elsewhere (health, the engines' event feeds, the policy's
   ``stats()``, the prefix index) are read at scrape time.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvpeer.router.config import RouterConfig
from kvpeer.router.cost import CostModel
from kvpeer.router.engineload import EngineLoadFeed
from kvpeer.router.feed import FeedStatistics
from kvpeer.router.health import EngineHealth
from kvpeer.router.index import PrefixIndex

__all__ = [
    "FAMILIES",
    "LATENCY_BUCKETS",
    "PREFIX",
    "Family",
    "FeedView",
    "Kind",
    "LiveCollector",
    "RouterMetrics",
    "RouterView",
    "markdown_table",
]

log = logging.getLogger(__name__)

PREFIX = "kvpeer_router_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: ``engine`` on a request no engine served (a bad request, none healthy).
NO_ENGINE = ""


class Kind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class Family:
    """One exported family: ``name`` as exposed after the prefix (counters with
    ``_total``), its type, label names and meaning; ``scope`` ``"discovery"``: exported
    only by a router with ``[discovery]`` (kvpeer.router.generations)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    scope: str = ""

    @property
    def full_name(self) -> str:
        return PREFIX + self.name

    @property
    def family_name(self) -> str:
        """The family's name as prometheus_client holds it (a counter's without _total)."""
        if self.kind is Kind.COUNTER:
            return self.full_name.removesuffix("_total")
        return self.full_name


C, G, H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM
_E = ("engine",)

#: Counters of :class:`~kvpeer.router.decide.RouterPolicy`'s ``stats()`` (each exported as
#: ``kvpeer_router_policy_<name>``, at zero until it moves).
POLICY_COUNTERS: dict[str, str] = {
    "plans_total": "Plans the policy made.",
    "pulls_planned_total": "Plans that name a source to pull from.",
    "predicted_pulled_tokens_planned_total": "Prompt tokens plans predicted would be pulled.",
    "explorations_total": "Pulls predicted a little slower than computing, tried anyway "
                          "(plan reason `pull: exploring`).",
    "outcomes_total": "Outcomes the policy heard.",
    "outcomes_failed_total": "Outcomes of failed requests (not learned from).",
    "outcomes_unmatched_total": "Outcomes without a pending plan (not learned from).",
    "outcomes_warmup_total": "Outcomes of an engine's first request since (re)start "
                             "(its warm-up; not learned from).",
    "pending_dropped_total": "Pending plans dropped before their outcome (too many pending).",
    "predicted_cached_tokens_total": "Cached prompt tokens plans predicted (outcomes whose "
                                     "engine reported cached_tokens).",
    "actual_cached_tokens_total": "Cached prompt tokens engines reported (same outcomes).",
    "cached_tokens_abs_error_total": "Sum of |actual - predicted| cached tokens.",
    "cached_tokens_unreported_total": "Outcomes whose engine reported no cached_tokens.",
    "pulls_missed_total": "Planned pulls whose outcome showed nothing pulled (no more "
                          "cached tokens than the engine's own).",
    "pulls_hidden_total": "Pulls started ahead that hid entirely behind the engine's queue "
                          "(the pull line learns nothing from them).",
    "pulled_tokens_observed_total": "Tokens pulls brought, as their outcomes showed "
                                    "(learned from).",
}
#: The policy's learned rates: ``rate:<name>[:<who>]`` -> (family, label of ``who``).
POLICY_RATES: dict[str, tuple[str, str | None]] = {
    "cold_session_s": ("policy_cold_session_seconds", None),
    "source_busy_s": ("policy_source_busy_seconds", None),
    "source_busy_own_s": ("policy_source_busy_own_seconds", "source"),
    "overhead_s": ("policy_overhead_seconds", "engine"),
    "prefill_s_per_token": ("policy_prefill_seconds_per_token", "engine"),
    "pull_base_s": ("policy_pull_base_seconds", "source"),
    "pull_s_per_token": ("policy_pull_seconds_per_token", "source"),
}

FAMILIES: tuple[Family, ...] = (
    # the edge, per request
    Family("requests_total", C, "Client generation requests by mode, outcome and the "
           "engine that served the last attempt (`\"\"`: none did).",
           ("mode", "outcome", "engine")),
    Family("request_duration_seconds", H, "Client request duration, arrival to last byte.",
           ("mode", "engine")),
    Family("ttft_seconds", H, "Client request arrival to its first byte, by serving engine.",
           ("mode", "engine")),
    Family("prefill_leg_seconds", H, "PD prefill leg duration (successful legs), by prefill "
           "engine.", _E),
    Family("retries_total", C, "Serving legs re-sent to another engine (before the first "
           "byte)."),
    Family("fallbacks_total", C, "PD prefill legs that failed: the request went decode-only."),
    Family("prefetches_total", C, "Prefetches to serving engines' tiers (pulling ahead): "
           "sent, dropped (queue full), refused by the tier.", ("outcome",)),
    Family("upstream_errors_total", C, "Failed engine calls by reason.", ("reason",)),
    Family("client_kv_params_stripped_total", C, "Client requests that carried routing "
           "fields (removed)."),
    Family("tokenize_failures_total", C, "Prompts routed by load because /tokenize failed."),
    Family("policy_errors_total", C, "Plans replaced by load-only (the policy raised or "
           "named an engine it may not use).", ("kind",)),
    Family("last_resort_total", C, "Requests sent to an engine that was down but not known "
           "gone, because none was healthy."),
    Family("predicted_cached_tokens_total", C, "Cached prompt tokens the plan predicted "
           "(requests whose engine reported cached_tokens)."),
    Family("actual_cached_tokens_total", C, "Cached prompt tokens the engine reported."),
    Family("drained_requests_total", C, "Requests still in flight when the router stopped: "
           "finished within drain_timeout_s, or cut.", ("result",)),
    # health and load
    Family("engine_up", G, "1 if the engine is routable.", _E),
    Family("engines_healthy", G, "Routable engines."),
    Family("in_flight", G, "This router's requests sent to the engine and not finished.", _E),
    Family("engine_restarts_total", C, "Engines seen down then up again, judged restarted "
           "(index forgotten)."),
    Family("engine_flaps_total", C, "Engines seen down then up again, judged the same "
           "process (index kept)."),
    Family("engine_returns_total", C, "Engines seen down then up again, by the evidence that "
           "decided (witness_new, refused, failures: restarted; witness_same, none: a flap).",
           ("evidence",)),
    Family("engine_reported_requests", G, "Running plus waiting requests the engine last "
           "reported on its /metrics (every router's; absent when stale).", _E),
    Family("load_scrapes_total", C, "Scrapes of engines' /metrics for their load."),
    Family("load_scrape_failures_total", C, "Scrapes of engines' /metrics that failed."),
    Family("source_held_share", G, "Share of peers' lookups the source's tier answered from "
           "held blocks lately (its `peer_lookups_total`, smoothed; 1 until it reports): a "
           "busy source's quote adds its serve wait times the rest. Sources with `held`.",
           ("source",)),
    Family("source_engine_wait_seconds", G, "How long the source's tier makes a pull it "
           "cannot answer held wait for its busy engine at most, as the router quotes it: "
           "the `engine_wait_seconds` its /metrics reports, else for a `held` source the "
           "cost model's prior (0.25, the tier's default); +Inf: no bound. With a cost "
           "model (policies `pull`, `affinity`).", ("source",)),
    # the engines' KV event feeds (kvpeer.router.feed)
    Family("feed_synced", G, "1 while the router follows the engine's KV events from a "
           "known point (KV-aware routing on for it); 0: routed by load only.", _E),
    Family("feed_batches_applied_total", C, "KV event batches applied to the index.", _E),
    Family("feed_gaps_total", C, "Sequence gaps seen in the engine's KV events.", _E),
    Family("feed_restarts_total", C, "New engine processes seen in its KV events.", _E),
    Family("feed_resets_total", C, "Times the index forgot the engine (a gap that could not "
           "be replayed, a rejected batch, a restart).", _E),
    Family("feed_replays_total", C, "Replays asked of the engine's replay endpoint, by "
           "result (requested, completed, incomplete, reasked, over_budget).",
           ("engine", "result")),
    Family("feed_dropped_total", C, "KV event frames and batches dropped, by reason (a "
           "batch the decoder refused names its fault).", ("engine", "reason")),
    Family("feed_skipped_events_total", C, "Events the decoder left out of applied batches, "
           "by reason.", ("engine", "reason")),
    Family("feed_unknown_fields_total", C, "Batches carrying fields this router does not know "
           "(a newer vLLM's), decoded without them, by the first such field's name.",
           ("engine", "field")),
    # the prefix index
    Family("index_blocks", G, "Blocks the index holds per engine and medium (bounded by "
           "what the engine holds).", ("engine", "medium")),
    Family("index_hash_mappings", G, "Engine block hashes the index maps to chain keys "
           "(live and recently removed).", _E),
    Family("index_speculative", G, "Live speculative entries (sent, not yet confirmed).", _E),
    Family("index_events_total", C, "What the index met applying KV events, by kind.",
           ("kind",)),
    # the policy (RouterPolicy.stats())
    *(Family("policy_" + name, C, doc) for name, doc in POLICY_COUNTERS.items()),
    Family("policy_plans_by_reason_total", C, "Plans by reason (`cache`, `pull`, `load`, "
           "`compute: pull slower`, ...).", ("reason",)),
    Family("policy_cached_tokens_error", H, "Actual minus predicted cached tokens per "
           "outcome (buckets in tokens)."),
    Family("policy_pending_plans", G, "Plans waiting for their outcome."),
    Family("policy_cold_session_seconds", G, "Learned cost of a pull's first session to a "
           "source."),
    Family("policy_source_busy_seconds", G, "Learned extra cost of pulling from a busy "
           "source, the fleet's (quoted for sources not yet seen busy)."),
    Family("policy_source_busy_own_seconds", G, "Learned extra cost of pulling from a "
           "busy source, per source seen busy.", ("source",)),
    Family("policy_overhead_seconds", G, "Learned fixed cost of a request per engine "
           "(`*`: pooled over engines).", _E),
    Family("policy_prefill_seconds_per_token", G, "Learned prefill time per prompt token "
           "per engine (`*`: pooled).", _E),
    Family("policy_pull_base_seconds", G, "Learned fixed cost of a pull per source "
           "(`*`: pooled over sources, quoted for those with few pulls).", ("source",)),
    Family("policy_pull_seconds_per_token", G, "Learned pull time per token per source "
           "(`*`: pooled).", ("source",)),
    # engine discovery (kvpeer.router.generations), with [discovery] only
    Family("discovery_engines", G, "Engines discovered now.", scope="discovery"),
    Family("discovery_observations_total", C, "Observations of the discovery source, by "
           "result (ok, failed).", ("result",), scope="discovery"),
    Family("discovery_changes_total", C, "Engines that joined, left or moved (a new "
           "address).", ("change",), scope="discovery"),
    Family("discovery_generations_total", C, "Router generations started (one per change).",
           scope="discovery"),
    Family("discovery_skipped_records_total", C, "Records the source answered that were no "
           "usable engine.", scope="discovery"),
)
_BY_NAME = {f.name: f for f in FAMILIES}


def markdown_table() -> str:
    """docs/metrics.md's table of router metrics (a test keeps the two equal)."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for f in FAMILIES:
        labels = ", ".join(f"`{label}`" for label in f.labels) or "-"
        scope = f"With `[{f.scope}]`: " if f.scope else ""
        rows.append(f"| `{f.full_name}` | {f.kind.value} | {labels} | {scope}{f.help} |")
    return "\n".join(rows)


class _InFlight(Protocol):
    in_flight: int


class FeedView(Protocol):
    """One engine's event feed, as the live gauges read it."""

    @property
    def engine(self) -> str: ...

    def statistics(self) -> FeedStatistics: ...


class RouterView(Protocol):
    """What the live gauges read from the router at scrape time."""

    config: RouterConfig
    health: EngineHealth
    index: PrefixIndex | None
    engine_load: EngineLoadFeed | None

    @property
    def policy(self) -> object: ...

    @property
    def feeds(self) -> Sequence[FeedView]: ...

    def load_of(self, name: str) -> _InFlight: ...


class RouterMetrics:
    """The edge's counters and histograms, declared in :data:`FAMILIES`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str) -> Counter:
            f = _BY_NAME[name]
            assert f.kind is Kind.COUNTER
            return Counter(f.family_name, f.help, f.labels, registry=registry)

        def histogram(name: str) -> Histogram:
            f = _BY_NAME[name]
            assert f.kind is Kind.HISTOGRAM
            return Histogram(f.full_name, f.help, f.labels, buckets=LATENCY_BUCKETS,
                             registry=registry)

        self.requests = counter("requests_total")
        self.retries = counter("retries_total")
        self.fallbacks = counter("fallbacks_total")
        self.prefetches = counter("prefetches_total")
        self.upstream_errors = counter("upstream_errors_total")
        self.stripped = counter("client_kv_params_stripped_total")
        self.tokenize_failures = counter("tokenize_failures_total")
        self.policy_errors = counter("policy_errors_total")
        self.last_resort = counter("last_resort_total")
        self.restarts = counter("engine_restarts_total")
        self.flaps = counter("engine_flaps_total")
        self.predicted_cached = counter("predicted_cached_tokens_total")
        self.actual_cached = counter("actual_cached_tokens_total")
        self.drained = counter("drained_requests_total")
        self.duration = histogram("request_duration_seconds")
        self.ttft = histogram("ttft_seconds")
        self.prefill_leg = histogram("prefill_leg_seconds")


def _gauge(name: str) -> GaugeMetricFamily:
    f = _BY_NAME[name]
    assert f.kind is Kind.GAUGE
    return GaugeMetricFamily(f.full_name, f.help, labels=f.labels or None)


def _counter(name: str) -> CounterMetricFamily:
    f = _BY_NAME[name]
    assert f.kind is Kind.COUNTER
    return CounterMetricFamily(f.family_name, f.help, labels=f.labels or None)


class LiveCollector(Collector):
    """Families read at scrape time: health, load, the engines' event feeds, the prefix
    index and the policy's own stats."""

    def __init__(self, router: RouterView) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        up, flight = _gauge("engine_up"), _gauge("in_flight")
        for entry in router.config.engines:
            up.add_metric([entry.name], float(router.health.healthy(entry.name)))
            flight.add_metric([entry.name], float(router.load_of(entry.name).in_flight))
        yield up
        yield flight
        feed = router.engine_load
        if feed is not None:
            reported = _gauge("engine_reported_requests")
            for entry in router.config.engines:
                report = feed.report(entry.name)
                if report is not None:
                    reported.add_metric([entry.name], report.running + report.waiting)
            yield reported
            shares = _gauge("source_held_share")
            for entry in router.config.engines:
                if entry.spec.serves_held:
                    shares.add_metric([entry.name], feed.held_share.share(entry.name))
            yield shares
            stats = feed.statistics()
            for name, value in (("load_scrapes_total", stats["scrapes_total"]),
                                ("load_scrape_failures_total", stats["scrape_failures_total"])):
                family = _counter(name)
                family.add_metric([], float(value))
                yield family
        cost = getattr(router.policy, "cost", None)
        if isinstance(cost, CostModel):
            bounds = _gauge("source_engine_wait_seconds")
            for entry in router.config.engines:
                said = feed.engine_wait_s(entry.name) if feed is not None else None
                bound = cost.engine_wait_bound(said, bounded=entry.spec.serves_held)
                bounds.add_metric([entry.name], math.inf if bound is None else bound)
            yield bounds
        health = router.health.statistics()
        healthy = _gauge("engines_healthy")
        healthy.add_metric([], float(len(health.up)))
        yield healthy
        returns = _counter("engine_returns_total")
        for evidence, count in health.verdicts:
            returns.add_metric([evidence], float(count))
        yield returns
        if router.feeds:
            yield from _feed_metrics(router.feeds)
        if router.index is not None:
            yield from _index_metrics(router.index)
        yield from _policy_metrics(_policy_numbers(router.policy))


def _feed_metrics(feeds: Sequence[FeedView]) -> Iterator[Metric]:
    """Each engine's KV event feed: whether it is followed, and what it lost and why."""
    synced = _gauge("feed_synced")
    applied, gaps = _counter("feed_batches_applied_total"), _counter("feed_gaps_total")
    restarts, resets = _counter("feed_restarts_total"), _counter("feed_resets_total")
    replays, dropped = _counter("feed_replays_total"), _counter("feed_dropped_total")
    skipped = _counter("feed_skipped_events_total")
    unknown = _counter("feed_unknown_fields_total")
    for feed in feeds:
        engine, stats = feed.engine, feed.statistics()
        synced.add_metric([engine], float(stats.synced))
        applied.add_metric([engine], float(stats.batches_applied))
        gaps.add_metric([engine], float(stats.gaps))
        restarts.add_metric([engine], float(stats.restarts))
        resets.add_metric([engine], float(stats.resets))
        for result, count in (("requested", stats.replays_requested),
                              ("completed", stats.replays_completed),
                              ("incomplete", stats.replays_incomplete),
                              ("reasked", stats.replays_reasked),
                              ("over_budget", stats.replays_over_budget)):
            replays.add_metric([engine, result], float(count))
        for reason, count in stats.dropped:
            dropped.add_metric([engine, reason], float(count))
        for reason, count in stats.skipped:
            skipped.add_metric([engine, reason], float(count))
        for name, count in stats.unknown_fields:
            unknown.add_metric([engine, name[:64]], float(count))
    yield from (synced, applied, gaps, restarts, resets, replays, dropped, skipped, unknown)


def _policy_metrics(numbers: Mapping[str, float]) -> Iterator[Metric]:
    """The policy's ``stats()`` as typed families. RouterPolicy's keys are declared in
    :data:`FAMILIES`; another policy's plain numeric keys are exported as
    ``policy_<key>`` (a counter if the key ends in ``_total``, else a gauge); keys of
    any other shape are left out."""
    if not numbers:
        return
    families: dict[str, Metric] = {}
    if "plans_total" in numbers:  # RouterPolicy: every rate family, learned or not yet
        families.update({name: _gauge(name) for name, _label in POLICY_RATES.values()})
    reasons = _counter("policy_plans_by_reason_total")
    buckets: list[tuple[str, float]] = []
    for key, value in numbers.items():
        head, _, rest = key.partition(":")
        if head == "plans_by_reason":
            reasons.add_metric([rest], value)
        elif head == "cached_tokens_error_bucket" and rest.startswith("le="):
            buckets.append((rest.removeprefix("le="), value))
        elif head == "rate":
            rate, _, who = rest.partition(":")
            target = POLICY_RATES.get(rate)
            if target is None or (target[1] is None) != (who == ""):
                continue
            name, _label = target
            family = families.get(name)
            if family is None:
                family = families[name] = _gauge(name)
            assert isinstance(family, GaugeMetricFamily)
            family.add_metric([who] if who else [], value)
        elif rest or not key.isidentifier():
            continue
        elif key in POLICY_COUNTERS or key == "pending_plans":
            continue  # below, at zero if absent
        else:
            full = PREFIX + "policy_" + key
            doc = f"the routing policy's {key}"
            kind = CounterMetricFamily if key.endswith("_total") else GaugeMetricFamily
            families[key] = kind(full, doc, value=value)
    if "plans_total" in numbers:  # RouterPolicy (a custom policy's stats stand alone)
        for name in POLICY_COUNTERS:
            family = _counter("policy_" + name)
            family.add_metric([], numbers.get(name, 0.0))
            yield family
        pending = _gauge("policy_pending_plans")
        pending.add_metric([], numbers.get("pending_plans", 0.0))
        yield pending
        yield reasons
    else:
        for name in ("pending_plans", *POLICY_COUNTERS):
            if name in numbers:
                plain = (_gauge if name == "pending_plans" else _counter)("policy_" + name)
                plain.add_metric([], numbers[name])
                yield plain
    if buckets and buckets[-1][0] == "+Inf":
        error = HistogramMetricFamily(
            _BY_NAME["policy_cached_tokens_error"].full_name,
            _BY_NAME["policy_cached_tokens_error"].help,
            buckets=buckets,
            # the signed sum of (actual - predicted) over the same outcomes
            sum_value=numbers.get("actual_cached_tokens_total", 0.0)
            - numbers.get("predicted_cached_tokens_total", 0.0),
        )
        yield error
    yield from families.values()


def _index_metrics(index: PrefixIndex) -> Iterator[Metric]:
    """What the prefix index holds per engine (its memory: chain keys, hash mappings,
    speculative entries) and its event counters (orphans, unknown removals, ...)."""
    stats = index.statistics(time.monotonic())
    blocks, mappings = _gauge("index_blocks"), _gauge("index_hash_mappings")
    speculative, events = _gauge("index_speculative"), _counter("index_events_total")
    for engine, medium, count in stats.blocks:
        blocks.add_metric([engine, medium], float(count))
    for engine, count in stats.hash_mappings:
        mappings.add_metric([engine], float(count))
    for engine, count in stats.speculative:
        speculative.add_metric([engine], float(count))
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


