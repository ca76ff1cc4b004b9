"""``kvpeer bench trace``: a window of a production trace through ``kvpeer router`` and
two real ``vllm serve`` engines, per arm -- the spec, the requests and the report.

Split from :mod:`.trace_run` (which starts engines) so that everything here is tested
without vLLM. Rules:

1. A trace in Mooncake's format (:mod:`kvpeer.lab.trace`) is cut to ``window`` seconds
   from ``window_start``, its ids made ``block_tokens`` tokens (the engines' block:
   one id is one engine block, so a shared id is a shared cached block), its timestamps
   multiplied by ``time_scale``, and fitted to the engines' context
   (:func:`~kvpeer.lab.trace.scaling.fit_context`: a long prompt keeps its first blocks).
2. Each id is one fixed block of the serving model's ordinary token ids
   (:class:`~kvpeer.lab.trace.tokens.BlockTokens`); requests are sent at their
   timestamps by vLLM's own request function (or kvpeer's client), greedy, fixed
   output length.
3. **Reuse realised** is the prompt tokens the engines did not compute (their prefix
   cache and their connector's hits, from their own counters, over the window) over
   the window's infinite-cache reuse: tokens of each prompt's usable full blocks whose
   id an earlier request of the window had.
4. With ``repeat`` N the arms run in turns (A B C, A B C, ...), each turn on fresh
   engines and the same requests; an arm's reported figure is the median of its turns'
   (:func:`median_rows`), each turn's row is kept beside it. A row keeps every
   request's TTFT with its prompt and the engine that served it (``per_request``),
   which ``kvpeer lab fleet --measured`` compares the model against.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpeer.errors import ConfigError
from kvpeer.lab.bench.serve_bench import ARMS as SERVE_ARMS
from kvpeer.lab.bench.serve_client import Sender
from kvpeer.lab.bench.serve_stats import FleetCounters, RequestRecord
from kvpeer.lab.bench.serve_workloads import BLOCK_TOKENS, MAX_CONTEXT, VOCAB, BenchRequest
from kvpeer.lab.trace.mooncake import TraceRequest, read_trace
from kvpeer.lab.trace.scaling import TraceScale, fit_context, scale_trace
from kvpeer.lab.trace.tokens import BlockTokens

__all__ = [
    "TRACE_ARMS", "TraceBenchSpec", "bench_requests", "median_rows", "reusable_tokens",
    "summarise",
]

TRACE_ARMS = ("affinity", "load", "kvpeer", "vllm-p2p")
DEFAULT_ARMS = ("affinity", "load", "kvpeer")
QUICK_WINDOW_S = 4.0
MAX_REPEATS = 20
#: figures of an arm's row that :func:`median_rows` takes the median of over its turns
MEDIAN_FIELDS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "goodput",
                 "reuse_realised")
assert set(TRACE_ARMS) <= set(SERVE_ARMS)


@dataclass(frozen=True, slots=True)
class TraceBenchSpec:
    trace: Path
    arms: tuple[str, ...] = DEFAULT_ARMS
    block_tokens: int = BLOCK_TOKENS
    time_scale: float = 4.0
    window_start_s: float = 0.0
    window_s: float = 30.0
    slo_s: float = 2.0
    seed: int = 0
    sender: Sender = "vllm"
    data_plane: str = "shm"
    repeat: int = 1
    probe: bool = False  # measure the engines first (``kvpeer.lab.bench.trace_probe``)

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms if a not in TRACE_ARMS]
        if not self.arms or unknown:
            raise ConfigError(f"--arms: {','.join(self.arms) or 'none'}: choose from "
                              f"{', '.join(TRACE_ARMS)}")
        if self.block_tokens != BLOCK_TOKENS:
            raise ConfigError(f"--block-tokens {self.block_tokens}: the engines' block is "
                              f"{BLOCK_TOKENS} tokens; one trace id is one engine block")
        TraceScale(self.block_tokens, self.time_scale, self.window_start_s, self.window_s)
        if not self.slo_s > 0:
            raise ConfigError(f"--slo {self.slo_s}: must be > 0 s")
        if not 1 <= self.repeat <= MAX_REPEATS:
            raise ConfigError(f"--repeat {self.repeat}: must be 1..{MAX_REPEATS}")


def bench_requests(spec: TraceBenchSpec, requests: Sequence[TraceRequest] | None = None
                   ) -> tuple[list[TraceRequest], list[BenchRequest]]:  # fmt: skip
    """The window's requests fitted to the engines (rule 1) and as sent (rule 2)."""
    if requests is None:
        requests = read_trace(spec.trace)
    scaled = scale_trace(requests, TraceScale(spec.block_tokens, spec.time_scale,
                                              spec.window_start_s, spec.window_s))
    if not scaled:
        raise ConfigError(f"--trace {spec.trace}: no request in the window "
                          f"{spec.window_start_s:g}..{spec.window_start_s + spec.window_s:g} s")
    low, high = VOCAB
    tokens = BlockTokens(spec.block_tokens, vocab=high, reserved=low, seed=spec.seed)
    fitted: list[TraceRequest] = []
    sent: list[BenchRequest] = []
    for r in scaled:
        fit = fit_context(r, MAX_CONTEXT)
        fitted.append(fit)
        sent.append(BenchRequest(r.timestamp_ms / 1000.0, tuple(tokens.prompt(fit)),
                                 fit.output_length))
    return fitted, sent


def reusable_tokens(requests: Sequence[TraceRequest]) -> int:
    """Rule 3's denominator: with an infinite cache, the tokens no engine need compute."""
    seen: set[int] = set()
    total = 0
    for r in requests:
        usable = max(0, r.input_length - 1) // r.block_tokens
        ids = r.hash_ids[:usable]
        prefix = 0
        while prefix < len(ids) and ids[prefix] in seen:
            prefix += 1
        total += prefix * r.block_tokens
        seen.update(r.full_blocks)
    return total


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


def summarise(arm: str, records: Sequence[RequestRecord], counters: FleetCounters,
              reusable: int, slo_s: float) -> dict[str, Any]:  # fmt: skip
    """One arm's row: TTFTs, goodput against the SLO, reuse realised (rule 3)."""
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft_s for r in ok]
    reused = counters.local_hit_tokens + counters.external_hit_tokens
    return {
        "arm": arm, "requests": len(records), "errors": len(records) - len(ok),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_s": _percentile(ttfts, 50), "ttft_p90_s": _percentile(ttfts, 90),
        "ttft_p99_s": _percentile(ttfts, 99), "slo_s": slo_s,
        "goodput": sum(1 for t in ttfts if t <= slo_s) / len(records) if records else 0.0,
        "reused_tokens": reused, "reusable_tokens": reusable,
        "reuse_realised": reused / reusable if reusable else None,
        "plans": dict(counters.plans),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        # sent s, TTFT s, prompt tokens, serving engine, plan: in the window's order
        "per_request": [[round(r.sent_s, 4), round(r.ttft_s, 4), r.prompt_tokens, r.engine,
                         r.plan] for r in records if r.error is None],
    }


def median_rows(turns: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rule 4: one row per arm (in first-seen order), each :data:`MEDIAN_FIELDS` figure the
    median of the arm's turns (``None`` if a turn lacks it), ``turns`` the turns' count."""
    arms: dict[str, list[dict[str, Any]]] = {}
    for row in turns:
        arms.setdefault(row["arm"], []).append(row)
    out = []
    for arm, rows in arms.items():
        merged: dict[str, Any] = {
            "arm": arm, "turns": len(rows),
            "requests": rows[0]["requests"], "errors": sum(r["errors"] for r in rows),
            "slo_s": rows[0]["slo_s"], "reusable_tokens": rows[0]["reusable_tokens"],
        }
        for name in MEDIAN_FIELDS:
            values = [r[name] for r in rows]
            merged[name] = (None if any(v is None for v in values)
                            else statistics.median(values))
        out.append(merged)
    return out


def render(result: dict[str, Any]) -> str:
    lines = [
        f"{result['trace']}: window {result['window_start_s']:g}+{result['window_s']:g} s of "
        f"trace time x{result['time_scale']:g}, {result['requests']} requests, "
        f"{result['reusable_tokens']} tokens reusable with an infinite cache",
        "",
        f"{'arm':<10} {'mean s':>7} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'goodput':>8} "
        f"{'reuse':>7} {'errors':>6}",
    ]
    for row in result["arms"]:
        reuse = row["reuse_realised"]
        lines.append(
            f"{row['arm']:<10} {_f(row.get('ttft_mean_s'))} {_f(row['ttft_p50_s'])} "
            f"{_f(row['ttft_p90_s'])} {_f(row['ttft_p99_s'])} {100 * row['goodput']:>7.1f}% "
            f"{'-' if reuse is None else f'{100 * reuse:.1f}%':>7} {row['errors']:>6}"
        )
    for name, reason in result.get("arms_not_run", {}).items():
        lines.append(f"{name}: not run ({reason})")
    return "\n".join(lines)


def _f(value: float | None) -> str:
    return f"{'-':>7}" if value is None else f"{value:>7.3f}"
