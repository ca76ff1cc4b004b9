"""``kvpeer stats`` pointed at a router: one screen of it, from its ``kvpeer_router_*``.

A router's ``/metrics`` holds no node metrics; read as a node's it was a screen of zeros.
:func:`kind` tells the two apart, :func:`render` shows what a router operator reads
first: engines up and their KV event feeds, requests by outcome and engine, plans by
reason, pulls and prefetches, and :func:`samples` is the whole page for ``--json``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["NODE", "ROUTER", "kind", "render", "samples"]

ROUTER_PREFIX = "kvpeer_router_"
NODE_PREFIXES = ("kvpeer_", "vllm:kvpeer_")
NODE = "node"
ROUTER = "router"


def samples(text: str) -> dict[str, list[dict[str, Any]]]:
    """Every kvpeer sample of a /metrics page: name -> [{"labels": {...}, "value": v}]."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(NODE_PREFIXES):
                out[sample.name].append({"labels": dict(sample.labels), "value": sample.value})
    return dict(out)


def kind(page: dict[str, list[dict[str, Any]]]) -> str | None:
    """``ROUTER``, ``NODE`` or None (no kvpeer metrics at all)."""
    if any(name.startswith(ROUTER_PREFIX) for name in page):
        return ROUTER
    return NODE if page else None


def _sum_by(page: dict[str, list[dict[str, Any]]], name: str,
            label: str | None = None) -> dict[str, float]:  # fmt: skip
    totals: dict[str, float] = defaultdict(float)
    for sample in page.get(ROUTER_PREFIX + name, ()):
        totals[sample["labels"].get(label, "") if label else ""] += sample["value"]
    return dict(totals)


def _words(totals: dict[str, float], empty: str = "none") -> str:
    parts = [f"{key or '-'}={value:g}" for key, value in sorted(totals.items()) if value]
    return ", ".join(parts) or empty


def render(page: dict[str, list[dict[str, Any]]], source: str) -> str:
    """The one-screen view of a router's metrics."""
    up = _sum_by(page, "engine_up", "engine")
    synced = _sum_by(page, "feed_synced", "engine")
    in_flight = _sum_by(page, "in_flight", "engine")
    lines = [f"kvpeer router {source}", ""]
    healthy = sum(1 for value in up.values() if value)
    lines.append(f"engines           {healthy} of {len(up)} up")
    for engine in sorted(up):
        feed = ("no KV events" if engine not in synced
                else "KV events synced" if synced[engine] else "KV events NOT synced")
        lines.append(f"  {engine:<15} {'up' if up[engine] else 'DOWN'}, {feed}, "
                     f"{in_flight.get(engine, 0):g} in flight")
    lost = {
        "gaps": sum(_sum_by(page, "feed_gaps_total").values()),
        "incomplete replays": _sum_by(page, "feed_replays_total", "result").get("incomplete", 0),
        "batches dropped": sum(_sum_by(page, "feed_dropped_total").values()),
    }
    lines += [
        f"KV event losses   {_words(lost)}",
        f"requests          {_words(_sum_by(page, 'requests_total', 'outcome'))}",
        f"  by engine       {_words(_sum_by(page, 'requests_total', 'engine'))}",
        f"plans by reason   {_words(_sum_by(page, 'policy_plans_by_reason_total', 'reason'))}",
        f"pulls planned     {sum(_sum_by(page, 'policy_pulls_planned_total').values()):g}; "
        f"prefetches {_words(_sum_by(page, 'prefetches_total', 'outcome'))}",
        f"upstream errors   {_words(_sum_by(page, 'upstream_errors_total', 'reason'))}",
        f"retries           {sum(_sum_by(page, 'retries_total').values()):g}; PD fallbacks "
        f"{sum(_sum_by(page, 'fallbacks_total').values()):g}; last resort "
        f"{sum(_sum_by(page, 'last_resort_total').values()):g}",
    ]
    return "\n".join(lines)
