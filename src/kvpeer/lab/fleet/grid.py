"""Runs of the fleet model over fleet sizes, loads, links and policies, and their report.

Offered load is a fraction of the fleet's *no-reuse capacity*: the request rate at
which every engine would be busy all the time computing every prompt in full, alone,
plus its decode at the batch its KV memory allows (:func:`capacity_rps`). A load is
reached by scaling the trace's timestamps (``TraceScale.time_scale``), which keeps its
order and its shared prefixes (docs/fleet.md says what that changes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from kvpeer.lab.fleet.params import GpuModel
from kvpeer.lab.fleet.world import FleetResult, FleetSpec, run_fleet
from kvpeer.lab.trace.mooncake import TraceRequest
from kvpeer.lab.trace.reuse import infinite_cache_reuse
from kvpeer.lab.trace.scaling import TraceScale, scale_trace

__all__ = ["capacity_rps", "percentile", "run_at_load", "summary"]


def capacity_rps(requests: Sequence[TraceRequest], gpu: GpuModel) -> float:
    """One engine's no-reuse capacity on ``requests`` (module docstring), requests/s."""
    if not requests:
        return 0.0
    mean_kv = sum(r.input_length + r.output_length for r in requests) / len(requests)
    batch = max(1, min(gpu.max_num_seqs, int(gpu.kv_tokens // mean_kv)))
    seconds = 0.0
    for r in requests:
        seconds += gpu.prefill_alone_s(r.input_length)
        context = batch * (r.input_length + r.output_length / 2.0)
        seconds += max(0, r.output_length - 1) * gpu.step_s([], batch, int(context)) / batch
    return len(requests) / seconds


def run_at_load(spec: FleetSpec, requests: Sequence[TraceRequest], load: float) -> FleetResult:
    """``requests`` replayed at ``load`` x the fleet's no-reuse capacity."""
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    rate = len(requests) / span_s if span_s > 0 else float("inf")
    target = load * spec.engines * capacity_rps(requests, spec.gpu)
    scaled = scale_trace(requests, TraceScale(block_tokens=requests[0].block_tokens,
                                              time_scale=rate / target))
    return run_fleet(spec, scaled)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 100)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


def summary(result: FleetResult, load: float, pooled_reuse: float | None = None) -> dict[str, Any]:
    """One run as plain numbers (``--json``)."""
    spec = result.spec
    ttfts = result.ttfts
    met = sum(1 for t in ttfts if t <= spec.slo_s)
    out: dict[str, Any] = {
        "engines": spec.engines, "policy": spec.policy, "link": spec.link, "load": load,
        "held_sync": spec.held_sync, "ahead": spec.ahead,
        "seed": spec.seed, "requests": result.requests,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "slo_s": spec.slo_s, "goodput": met / result.requests if result.requests else 0.0,
        "goodput_rps": met / result.duration_s if result.duration_s > 0 else 0.0,
        "reuse": result.reuse, "blocks": result.blocks, "local_blocks": result.local_blocks,
        "fetched_blocks": result.fetched_blocks, "pulls": result.pulls,
        "bytes_moved": result.bytes_moved,
        "router_cpu_us_per_decision": 1e6 * result.router_cpu_s / max(1, result.decisions),
        "plan_reasons": result.plan_reasons,
        "by_reason": result.by_reason,
        "cost_rates": result.cost_rates,
    }
    if pooled_reuse is not None:
        out["reuse_vs_pooled"] = result.reuse / pooled_reuse if pooled_reuse else math.nan
    return out


def trace_facts(requests: Iterable[TraceRequest], gpu: GpuModel) -> dict[str, Any]:
    requests = list(requests)
    every = infinite_cache_reuse(requests)
    full = infinite_cache_reuse(requests, full_only=True)
    return {"requests": len(requests), "infinite_reuse": every.fraction,
            "infinite_reuse_full_blocks": full.fraction,
            "capacity_rps_per_engine": capacity_rps(requests, gpu)}


def specs(engines: Iterable[int], links: Iterable[str], policies: Iterable[str],
          base: FleetSpec) -> list[FleetSpec]:  # fmt: skip
    """Every combination; ``load`` and ``affinity`` never pull, so they run once (on the
    first link), as does nothing else."""
    links = list(links)
    out = []
    for n in engines:
        for policy in policies:
            for link in links if policy not in ("load", "affinity") else links[:1]:
                out.append(replace(base, engines=n, policy=policy, link=link))
    return out
