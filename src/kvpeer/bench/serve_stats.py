"""The serving benchmark's numbers: per-request records in, per arm x workload summaries,
ratios between arms, and the table out. Pure functions over values (no clock, no I/O), so
the tests pin them exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any

__all__ = [
    "ArmError",
    "Cell",
    "PeerCounters",
    "Ratio",
    "RequestRecord",
    "median_ratios",
    "percentile",
    "pool",
    "ratios",
    "render",
    "summarize",
]

BLOCK_TOKENS = 32


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds from the phase's start."""

    sent_s: float
    ttft_s: float  # sent → first generated token
    latency_s: float  # sent → stream ended
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens the engine did not compute (its cache or a pull)
    engine: str | None = None  # X-Kvpeer-Engine
    source: str | None = None  # X-Kvpeer-Source: the peer the router named
    error: str | None = None
    request_id: str | None = None  # X-Kvpeer-Request-Id: the kv_request_id (--trace)

    @property
    def done_s(self) -> float:
        return self.sent_s + self.latency_s

    @property
    def fell_back(self) -> bool:
        """The router named a peer, yet the engine took not one block from anywhere."""
        return self.source is not None and self.error is None and self.cached_tokens < BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class PeerCounters:
    """kvpeer's ``vllm:kvpeer_*`` counters summed over a fleet's engines."""

    pulled_blocks: float = 0.0
    pulled_bytes: float = 0.0
    failed_fetches: float = 0.0

    def __sub__(self, other: PeerCounters) -> PeerCounters:
        return PeerCounters(
            self.pulled_blocks - other.pulled_blocks,
            self.pulled_bytes - other.pulled_bytes,
            self.failed_fetches - other.failed_fetches,
        )


@dataclass(frozen=True, slots=True)
class Cell:
    """One arm x workload: the measured main-phase requests, summarized."""

    arm: str
    workload: str
    requests: int
    errors: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    requests_per_s: float | None
    output_tokens_per_s: float | None
    prompt_tokens: int
    cached_tokens: int  # from every engine's usage: its own cache or pulled
    computed_tokens: int  # prompt_tokens - cached_tokens
    pulled_tokens: int | None  # kvpeer's pulled blocks x block size (None: no kvpeer tier)
    pulls_named: int  # requests where the router named a peer
    pulls_fell_back: int  # ...of which the engine reused nothing
    failed_fetches: int | None  # kvpeer's failed loads (computed locally instead)
    ttfts_s: list[float] = field(default_factory=list)  # for the CDF
    #: each measured request in send order: sent, TTFT, latency, prompt and cached tokens,
    #: where it ran, the peer named and its kv_request_id (--trace: find its lines)
    per_request: list[dict[str, Any]] = field(default_factory=list)
    window_s: float = 0.0  # first send to last answer (the throughput's denominator)
    #: which repeat (--repeat: seed + repeat) this cell measured; None: every repeat, pooled
    repeat: int | None = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Ratio:
    """``arm`` / ``baseline`` on one workload (below 1: ``arm`` is faster)."""

    workload: str
    arm: str
    baseline: str
    ttft_p50: float | None
    ttft_p99: float | None
    repeat: int | None = 0  # the cells' repeat (None: pooled over every repeat)


@dataclass(frozen=True, slots=True)
class ArmError:
    """An arm that did not run (or stopped), and why."""

    arm: str
    reason: str


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default), or None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q}: must be within 0..100")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    arm: str,
    workload: str,
    records: Sequence[RequestRecord],
    counters: PeerCounters | None,
) -> Cell:
    """Summarize one arm x workload. Throughput is over the window from the first send to
    the last answer of the measured requests; ``counters`` (None: the arm has no kvpeer
    tier) are the main phase's change in kvpeer's counters."""
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft_s for r in ok]
    latencies = [r.latency_s for r in ok]
    window = (max(r.done_s for r in ok) - min(r.sent_s for r in ok)) if ok else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return Cell(
        arm=arm,
        workload=workload,
        requests=len(records),
        errors=len(records) - len(ok),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        requests_per_s=len(ok) / window if window > 0 else None,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / window if window > 0 else None,
        prompt_tokens=prompt,
        cached_tokens=cached,
        computed_tokens=prompt - cached,
        pulled_tokens=None if counters is None else int(counters.pulled_blocks) * BLOCK_TOKENS,
        pulls_named=sum(1 for r in ok if r.source is not None),
        pulls_fell_back=sum(1 for r in ok if r.fell_back),
        failed_fetches=None if counters is None else int(counters.failed_fetches),
        ttfts_s=sorted(ttfts),
        per_request=[_brief(r) for r in sorted(records, key=lambda r: r.sent_s)],
        window_s=window,
    )


def pool(cells: Sequence[Cell]) -> Cell:
    """One arm x workload over every repeat (``repeat`` None, even for one cell: an arm
    that stopped early still compares with the others' pooled cells): percentiles over
    all their requests, throughput over the sum of their windows, counts and counters
    summed. Each request of ``per_request`` names its repeat."""
    if not cells:
        raise ValueError("pool: no cells")
    first = cells[0]
    if any((c.arm, c.workload) != (first.arm, first.workload) for c in cells):
        raise ValueError(f"pool: cells of {first.arm}/{first.workload} and others mixed")
    rows = [{**row, "repeat": c.repeat} for c in cells for row in c.per_request]
    ok = [row for row in rows if row["error"] is None]
    ttfts = sorted(t for c in cells for t in c.ttfts_s)
    latencies = [row["latency_s"] for row in ok]
    window = sum(c.window_s for c in cells)
    done = sum(c.requests - c.errors for c in cells)
    output = sum((c.output_tokens_per_s or 0.0) * c.window_s for c in cells)
    prompt = sum(c.prompt_tokens for c in cells)
    cached = sum(c.cached_tokens for c in cells)
    pulled = [c.pulled_tokens for c in cells]
    failed = [c.failed_fetches for c in cells]
    return Cell(
        arm=first.arm,
        workload=first.workload,
        requests=sum(c.requests for c in cells),
        errors=sum(c.errors for c in cells),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        requests_per_s=done / window if window > 0 else None,
        output_tokens_per_s=output / window if window > 0 else None,
        prompt_tokens=prompt,
        cached_tokens=cached,
        computed_tokens=prompt - cached,
        pulled_tokens=None if None in pulled else sum(p or 0 for p in pulled),
        pulls_named=sum(c.pulls_named for c in cells),
        pulls_fell_back=sum(c.pulls_fell_back for c in cells),
        failed_fetches=None if None in failed else sum(f or 0 for f in failed),
        ttfts_s=ttfts,
        per_request=rows,
        window_s=window,
        repeat=None,
    )


def _brief(record: RequestRecord) -> dict[str, Any]:
    return {
        "sent_s": round(record.sent_s, 3),
        "ttft_s": round(record.ttft_s, 4),
        "latency_s": round(record.latency_s, 4),
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "engine": record.engine,
        "source": record.source,
        "error": record.error,
        "request_id": record.request_id,
    }


def ratios(
    cells: Sequence[Cell], arm: str = "kvpeer", baselines: Sequence[str] = ("none", "vllm-p2p")
) -> list[Ratio]:
    """``arm``'s TTFT p50 and p99 over each baseline's, per workload (and repeat) both
    ran: a repeat's cells are compared with the same repeat's, pooled with pooled."""
    by_key: Mapping[tuple[str, str, int | None], Cell] = {
        (c.arm, c.workload, c.repeat): c for c in cells
    }
    found: list[Ratio] = []
    for cell in cells:
        if cell.arm != arm:
            continue
        for baseline in baselines:
            base = by_key.get((baseline, cell.workload, cell.repeat))
            if base is None:
                continue
            found.append(
                Ratio(
                    cell.workload,
                    arm,
                    baseline,
                    _ratio(cell.ttft_p50_s, base.ttft_p50_s),
                    _ratio(cell.ttft_p99_s, base.ttft_p99_s),
                    cell.repeat,
                )
            )
    return found


def median_ratios(per_repeat: Sequence[Ratio]) -> list[Ratio]:
    """Per workload and baseline, the median over repeats of each repeat's ratio
    (``repeat`` None): the same-run comparison, repeated, robust to one noisy repeat."""
    groups: dict[tuple[str, str, str], list[Ratio]] = {}
    for r in per_repeat:
        groups.setdefault((r.workload, r.arm, r.baseline), []).append(r)
    return [
        Ratio(workload, arm, baseline, _median([r.ttft_p50 for r in group]),
              _median([r.ttft_p99 for r in group]), None)
        for (workload, arm, baseline), group in groups.items()
    ]  # fmt: skip


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return percentile(known, 50)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


def render(
    cells: Sequence[Cell],
    errors: Sequence[ArmError],
    seconds: float,
    setup_errors: Sequence[str] = (),
    logs: str | None = None,
    repeat_cells: Sequence[Cell] = (),
) -> str:
    """The table, the ratios, the arms that did not run, one summary line. With
    ``repeat_cells`` (--repeat) the table and first ratios are pooled over the repeats,
    followed by each repeat's ratios and their median."""
    header = (
        f"{'workload':<14} {'arm':<9} {'n':>3} {'err':>3} {'TTFT p50':>9} {'p90':>7} "
        f"{'p99':>7} {'e2e p50':>8} {'p99':>7} {'req/s':>6} {'out tok/s':>9} "
        f"{'prompt':>7} {'cached':>7} {'pulled':>7} {'named':>5} {'fell back':>9}"
    )
    lines = [header, "-" * len(header)]
    for c in sorted(cells, key=lambda c: (c.workload, c.arm)):
        lines.append(
            f"{c.workload:<14} {c.arm:<9} {c.requests:>3} {c.errors:>3} "
            f"{_ms(c.ttft_p50_s):>9} {_ms(c.ttft_p90_s):>7} {_ms(c.ttft_p99_s):>7} "
            f"{_ms(c.latency_p50_s):>8} {_ms(c.latency_p99_s):>7} {_num(c.requests_per_s):>6} "
            f"{_num(c.output_tokens_per_s):>9} {c.prompt_tokens:>7} {c.cached_tokens:>7} "
            f"{'-' if c.pulled_tokens is None else c.pulled_tokens:>7} {c.pulls_named:>5} "
            f"{c.pulls_fell_back:>9}"
        )
    found = ratios(cells)
    per_repeat = ratios(repeat_cells)
    repeats = len({c.repeat for c in repeat_cells})
    if found:
        lines.append("")
        pooled = f", {repeats} repeats pooled" if repeat_cells else ""
        lines.append(f"TTFT ratios (below 1: kvpeer faster{pooled})")
        for r in found:
            lines.append(
                f"  {r.workload:<14} {r.arm}/{r.baseline:<9} p50 {_times(r.ttft_p50):>6}  "
                f"p99 {_times(r.ttft_p99):>6}"
            )
    if per_repeat:
        lines.append("")
        lines.append("TTFT ratios per repeat (same seed, same run), and their median")
        medians = {(r.workload, r.baseline): r for r in median_ratios(per_repeat)}
        for (workload, baseline), median in medians.items():
            mine = [r for r in per_repeat if (r.workload, r.baseline) == (workload, baseline)]
            for name, pick in (("p50", attrgetter("ttft_p50")), ("p99", attrgetter("ttft_p99"))):
                each = " ".join(_times(pick(r)) for r in mine)
                lines.append(f"  {workload:<14} kvpeer/{baseline:<9} {name} {each}  "
                             f"median {_times(pick(median))}")  # fmt: skip
    for error in errors:
        lines.append(f"arm {error.arm} did not run: {error.reason}")
    lines.extend(setup_errors)
    lines.append("")
    lines.append(f"kvpeer bench serve: {len(cells)} arm x workload cells in {seconds:.0f} s")
    if logs:
        lines.append(f"engine logs: {logs}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _times(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if value >= 0.01 else f"{value:.3f}x"  # 0.004x, not 0.00x
