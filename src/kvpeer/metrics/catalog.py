"""The one catalog of kvpeer's metrics: names, types, units, labels, buckets, meaning.

Invariants:

1. Every label has a fixed, small set of values listed here (no peer, request or
   key ever becomes a label), so every series exists, at zero, from the first
   scrape on. The one exception is :data:`INFO`: one series whose label values
   describe the node.
2. Names carry no prefix: standalone nodes export ``kvpeer_<name>``, vLLM
   ``vllm:kvpeer_<name>``. Counters end in ``_total``, durations are seconds
   (``_seconds``), sizes bytes (``_bytes``).
3. Values come from the tier's own counters, read at scrape time
   (:mod:`kvpeer.metrics.reading`); the catalog holds no state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpeer.node.counters import (
    AHEAD_EVENTS,
    FETCH_SECONDS_BUCKETS,
    FETCH_SIZE_BUCKETS,
    LOOKUP_SECONDS_BUCKETS,
    PEER_LOOKUP_PATHS,
    PULL_WAIT_OUTCOMES,
    PULL_WAIT_SECONDS_BUCKETS,
    STEP_WAIT_SECONDS_BUCKETS,
)
from kvpeer.session import CloseKind

__all__ = [
    "CATALOG",
    "CLOSE_KINDS",
    "INFO",
    "LOOKUP_RESULTS",
    "PROTOCOL_ERROR_REASONS",
    "TIMEOUT_KINDS",
    "Metric",
    "MetricType",
    "by_name",
]


class MetricType(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric: ``label_values`` lists every label combination it has."""

    name: str
    type: MetricType
    unit: str
    help: str
    labels: tuple[str, ...] = ()
    label_values: tuple[tuple[str, ...], ...] = ((),)
    buckets: tuple[float, ...] = ()


def _one_label(*values: str) -> tuple[tuple[str, ...], ...]:
    return tuple((v,) for v in values)


LOOKUP_RESULTS = ("hit", "hit_pending", "retry", "miss")
FETCH_RESULTS = ("ok", "failed")
SESSION_EVENTS = ("opened", "closed", "refused")
CLOSE_KINDS = tuple(kind.value for kind in CloseKind)
TIMEOUT_KINDS = (
    "handshake",  # connected, never acknowledged (handshake_timeout_s)
    "lookup",  # consumer: probes unanswered (lookup_timeout_s)
    "load",  # consumer: fetch without transfer_done (load_timeout_s)
    "abort_ack",  # consumer: abort without ack (abort_ack_timeout_s)
    "give_up",  # consumer: a pull slower than computing, per the router (give_up_s)
    "lookup_pending",  # producer: HIT_PENDING/RETRY key answered MISS
    "engine_wait",  # producer: a lookup answered without its busy engine (engine_wait_s)
    "store",  # producer: pinned supply never fetched (store_timeout_s)
    "transfer",  # producer: a write outlived transfer_timeout_s
    "abort_drain",  # producer: aborted writes did not drain in time
    "unbound_store",  # producer: parked PD stores never fetched
)
#: Close kinds that mean a peer broke the protocol or its limits, plus frames
#: the node dropped: unknown message types and frames from no live session.
PROTOCOL_ERROR_REASONS = (
    CloseKind.PROTOCOL_ERROR.value,
    CloseKind.REJECTED.value,
    CloseKind.PEER_FAULT.value,
    CloseKind.OVER_BUDGET.value,
    "unknown_message",
    "stray_frame",
)

INFO = "info"

CATALOG: tuple[Metric, ...] = (
    Metric(
        "lookups_total",
        MetricType.COUNTER,
        "lookups",
        "Engine lookups the tier answered, by result (retry: asked the peer, answer pending).",
        ("result",),
        _one_label(*LOOKUP_RESULTS),
    ),
    Metric(
        "lookup_duration_seconds",
        MetricType.HISTOGRAM,
        "seconds",
        "Time from a key's first probe to the peer's answer, per lookup answer.",
        buckets=LOOKUP_SECONDS_BUCKETS,
    ),
    Metric(
        "fetches_total",
        MetricType.COUNTER,
        "fetches",
        "Loads (fetches from a peer) that ended, by result; failed ones compute locally.",
        ("result",),
        _one_label(*FETCH_RESULTS),
    ),
    Metric(
        "fetch_duration_seconds",
        MetricType.HISTOGRAM,
        "seconds",
        "Successful loads: fetch sent to transfer complete.",
        buckets=FETCH_SECONDS_BUCKETS,
    ),
    Metric(
        "fetch_size_bytes",
        MetricType.HISTOGRAM,
        "bytes",
        "Successful loads: bytes each one brought.",
        buckets=FETCH_SIZE_BUCKETS,
    ),
    Metric("pulled_blocks_total", MetricType.COUNTER, "blocks", "Blocks loads brought from peers."),
    Metric("pulled_bytes_total", MetricType.COUNTER, "bytes", "Bytes loads brought from peers."),
    Metric("served_blocks_total", MetricType.COUNTER, "blocks", "Blocks written to peers."),
    Metric("served_bytes_total", MetricType.COUNTER, "bytes", "Bytes written to peers."),
    Metric(
        "peer_step_wait_seconds",
        MetricType.HISTOGRAM,
        "seconds",
        "Peer lookups and releases waiting for an engine step: from the oldest one "
        "reaching the tier to the step that served it, per peer and step.",
        buckets=STEP_WAIT_SECONDS_BUCKETS,
    ),
    Metric(
        "peer_lookups_total",
        MetricType.COUNTER,
        "lookups",
        "Peers' lookups (a resolve fetch's included) by how they were answered: at once "
        "from held blocks, or in an engine step's serve window.",
        ("path",),
        _one_label(*PEER_LOOKUP_PATHS),
    ),
    Metric(
        "engine_wait_seconds",
        MetricType.GAUGE,
        "seconds",
        "How long a peer's lookup that held blocks cannot answer waits at most for the "
        "engine's step, then is answered misses (engine_wait_s; +Inf: null, no bound); "
        "routers quote this tier's pulls by it.",
    ),
    Metric(
        "pull_waits_total",
        MetricType.COUNTER,
        "pulls",
        "Pulls the engine's scheduler waited for inside the lookup that found them "
        "(sync_pull_wait_s): landed in that step, or missed the wait and landed later.",
        ("outcome",),
        _one_label(*PULL_WAIT_OUTCOMES),
    ),
    Metric(
        "pull_wait_seconds",
        MetricType.HISTOGRAM,
        "seconds",
        "How long the engine's scheduler waited, inside a lookup, for a pull.",
        buckets=PULL_WAIT_SECONDS_BUCKETS,
    ),
    Metric("sessions", MetricType.GAUGE, "sessions", "Peer sessions open now."),
    Metric(
        "session_events_total",
        MetricType.COUNTER,
        "events",
        "Peer sessions opened, closed, and peers refused (allow-list, caps, checks).",
        ("event",),
        _one_label(*SESSION_EVENTS),
    ),
    Metric(
        "sessions_closed_total",
        MetricType.COUNTER,
        "sessions",
        "Peer sessions that ended, by why (the session's close kind).",
        ("kind",),
        _one_label(*CLOSE_KINDS),
    ),
    Metric(
        "timeouts_total",
        MetricType.COUNTER,
        "timeouts",
        "Timers that expired, by kind (the config key is named in docs/configuration.md).",
        ("kind",),
        _one_label(*TIMEOUT_KINDS),
    ),
    Metric(
        "late_fetches_rejected_total",
        MetricType.COUNTER,
        "fetches",
        "Fetches rejected at once because their id's parked stores were reaped.",
    ),
    Metric(
        "unbound_stores_reaped_total",
        MetricType.COUNTER,
        "jobs",
        "Parked PD store jobs failed because no fetch came (unbound_store_timeout_s).",
    ),
    Metric("tombstones", MetricType.GAUGE, "ids", "PD ids whose late fetches are rejected now."),
    Metric("loads_in_flight", MetricType.GAUGE, "loads", "Loads waiting for a peer now."),
    Metric("transfers_in_flight", MetricType.GAUGE, "transfers", "Writes to peers running now."),
    Metric("pinned_blocks", MetricType.GAUGE, "blocks", "Blocks pinned for peers now."),
    Metric(
        "held_blocks", MetricType.GAUGE, "blocks", "Blocks kvpeer holds a copy of (held_bytes)."
    ),
    Metric("held_bytes", MetricType.GAUGE, "bytes", "Bytes of held blocks now (<= held_bytes)."),
    Metric(
        "staged_blocks",
        MetricType.GAUGE,
        "blocks",
        "Blocks pulled ahead of their request, in staging rows now (staging_blocks).",
    ),
    Metric(
        "pull_ahead_total",
        MetricType.COUNTER,
        "events",
        "Pulling ahead: prefetches received and refused, blocks fetched, staged, used, "
        "expired or evicted, fetches failed, engine jobs served from staging or failed.",
        ("event",),
        _one_label(*AHEAD_EVENTS),
    ),
    Metric("parked_stores", MetricType.GAUGE, "jobs", "PD store jobs waiting for their fetch now."),
    Metric(
        "protocol_errors_total",
        MetricType.COUNTER,
        "errors",
        "Peer misbehaviour: sessions ended by it, by close kind, and frames dropped.",
        ("reason",),
        _one_label(*PROTOCOL_ERROR_REASONS),
    ),
    Metric(
        "idle_wakeups_total",
        MetricType.COUNTER,
        "wakeups",
        "Times the tier woke an idle engine to answer a peer.",
    ),
    Metric(
        "thread_cpu_seconds_total",
        MetricType.COUNTER,
        "seconds",
        "CPU time (user + system) of kvpeer's own threads (named kvpeer-*).",
    ),
    Metric(
        INFO,
        MetricType.GAUGE,
        "",
        "Always 1; labels: kvpeer version, wire protocol version, data planes offered.",
        ("version", "protocol", "data_planes"),
        (),
    ),
)


def by_name() -> dict[str, Metric]:
    return {metric.name: metric for metric in CATALOG}


def series_count() -> int:
    """How many series the catalog has (histograms count once)."""
    return sum(max(1, len(m.label_values)) for m in CATALOG)


def markdown_table() -> str:
    """docs/metrics.md's table of metrics (a test keeps the two equal)."""
    rows = ["| metric | type | labels (values) | meaning |", "|---|---|---|---|"]
    for m in CATALOG:
        if m.labels and m.label_values:
            values = ", ".join(v[0] if len(v) == 1 else "/".join(v) for v in m.label_values)
            labels = f"`{'`, `'.join(m.labels)}` ({values})"
        else:
            labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
        rows.append(f"| `kvpeer_{m.name}` | {m.type.value} | {labels} | {m.help} |")
    return "\n".join(rows)
