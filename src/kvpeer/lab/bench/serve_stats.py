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
    "FleetCounters",
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
    #: prompt tokens the engine did not compute (its cache or a pull); None: the sender
    #: does not see it (vLLM's request function)
    cached_tokens: int | None
    engine: str | None = None  # X-Kvpeer-Engine
    source: str | None = None  # X-Kvpeer-Source: the peer the router named
    error: str | None = None
    request_id: str | None = None  # X-Kvpeer-Request-Id: the kv_request_id (--trace)
    plan: str | None = None  # X-Kvpeer-Plan: the router's reason for its plan
    predicted_ttft_s: float | None = None  # X-Kvpeer-Predicted-Ttft-Seconds
    #: X-Kvpeer-Rejected-Pull-Ttft-Seconds: the pull a ``compute: pull slower`` plan
    #: passed over, as the router predicted it
    rejected_pull_ttft_s: float | None = None

    @property
    def done_s(self) -> float:
        return self.sent_s + self.latency_s

    @property
    def fell_back(self) -> bool:
        """The router named a peer, yet the engine took not one block from anywhere."""
        return (
            self.source is not None
            and self.error is None
            and self.cached_tokens is not None
            and self.cached_tokens < BLOCK_TOKENS
        )


@dataclass(frozen=True, slots=True)
class PeerCounters:
    """kvpeer's ``vllm:kvpeer_*`` counters summed over a fleet's engines."""

    pulled_blocks: float = 0.0
    pulled_bytes: float = 0.0
    failed_fetches: float = 0.0
    pulls: float = 0.0  # loads from peers that completed

    def __sub__(self, other: PeerCounters) -> PeerCounters:
        return PeerCounters(
            self.pulled_blocks - other.pulled_blocks,
            self.pulled_bytes - other.pulled_bytes,
            self.failed_fetches - other.failed_fetches,
            self.pulls - other.pulls,
        )


@dataclass(frozen=True, slots=True)
class FleetCounters:
    """What every arm's engines and shared router count, summed over the engines."""

    local_hit_tokens: float = 0.0  # vllm:prefix_cache_hits (the engine's own KV cache)
    #: vllm:external_prefix_cache_hits: tokens the KV connector loaded (its CPU tier, or
    #: pulled by a secondary tier)
    external_hit_tokens: float = 0.0
    plans: tuple[tuple[str, float], ...] = ()  # the shared router's plans by reason
    engine_cpu_s: float | None = None  # CPU time of the engines' processes (None: unread)

    def __sub__(self, other: FleetCounters) -> FleetCounters:
        before = dict(other.plans)
        cpu = (None if self.engine_cpu_s is None or other.engine_cpu_s is None
               else self.engine_cpu_s - other.engine_cpu_s)  # fmt: skip
        return FleetCounters(
            self.local_hit_tokens - other.local_hit_tokens,
            self.external_hit_tokens - other.external_hit_tokens,
            tuple((reason, n - before.get(reason, 0.0)) for reason, n in self.plans),
            cpu,
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
    cached_tokens: int  # from every engine's usage (its own cache or pulled), where seen
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
    ttft_mean_s: float | None = None
    offered_rate: float | None = None  # requests/s offered (Poisson); None: not recorded
    local_hit_tokens: int | None = None  # the engines' own prefix-cache hits (None: unread)
    external_hit_tokens: int | None = None  # loaded by the KV connector (CPU tier, pulls)
    pulls: int | None = None  # kvpeer loads from peers completed (None: no kvpeer tier)
    pulled_bytes: int | None = None
    plans: dict[str, int] = field(default_factory=dict)  # the router's plans by reason
    #: plans against outcomes: per reason, the requests, their mean predicted and mean
    #: measured TTFT (seconds), from each answer's X-Kvpeer-Plan headers
    outcomes: dict[str, dict[str, float]] = field(default_factory=dict)
    #: CPU seconds the engines' processes used over the main phase (None: not read)
    engine_cpu_s: float | None = None

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
    ttft_mean: float | None = None
    ttft_p90: float | None = None


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
    fleet: FleetCounters | None = None,
    offered_rate: float | None = None,
) -> Cell:
    """Summarize one arm x workload. Throughput is over the window from the first send to
    the last answer of the measured requests; ``counters`` (None: the arm has no kvpeer
    tier) and ``fleet`` (None: not read) are the main phase's change in the counters."""
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft_s for r in ok]
    latencies = [r.latency_s for r in ok]
    window = (max(r.done_s for r in ok) - min(r.sent_s for r in ok)) if ok else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
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
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else None,
        offered_rate=offered_rate,
        local_hit_tokens=None if fleet is None else int(fleet.local_hit_tokens),
        external_hit_tokens=None if fleet is None else int(fleet.external_hit_tokens),
        pulls=None if counters is None else int(counters.pulls),
        pulled_bytes=None if counters is None else int(counters.pulled_bytes),
        plans={} if fleet is None else {r: int(n) for r, n in fleet.plans if n},
        outcomes=_outcomes(ok),
        engine_cpu_s=None if fleet is None else fleet.engine_cpu_s,
    )


def _outcomes(records: Sequence[RequestRecord]) -> dict[str, dict[str, float]]:
    """Per plan reason: requests, mean predicted TTFT, mean measured TTFT; for plans that
    passed a pull over, also the mean predicted TTFT of that pull."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        if record.plan is not None and record.predicted_ttft_s is not None:
            groups.setdefault(record.plan, []).append(record)
    found: dict[str, dict[str, float]] = {}
    for reason, group in sorted(groups.items()):
        found[reason] = {
            "n": float(len(group)),
            "predicted_mean_s": sum(r.predicted_ttft_s or 0.0 for r in group) / len(group),
            "actual_mean_s": sum(r.ttft_s for r in group) / len(group),
        }
        rejected = [r.rejected_pull_ttft_s for r in group if r.rejected_pull_ttft_s is not None]
        if rejected:
            found[reason]["rejected_pull_mean_s"] = sum(rejected) / len(rejected)
    return found


def _sum_known(values: Sequence[int | None]) -> int | None:
    """The sum, or None if any value is unknown."""
    return None if None in values else sum(v or 0 for v in values)


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
        pulled_tokens=_sum_known(pulled),
        pulls_named=sum(c.pulls_named for c in cells),
        pulls_fell_back=sum(c.pulls_fell_back for c in cells),
        failed_fetches=_sum_known(failed),
        ttfts_s=ttfts,
        per_request=rows,
        window_s=window,
        repeat=None,
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else None,
        offered_rate=first.offered_rate,
        local_hit_tokens=_sum_known([c.local_hit_tokens for c in cells]),
        external_hit_tokens=_sum_known([c.external_hit_tokens for c in cells]),
        pulls=_sum_known([c.pulls for c in cells]),
        pulled_bytes=_sum_known([c.pulled_bytes for c in cells]),
        plans=_sum_plans([c.plans for c in cells]),
        outcomes=_outcomes([_record(row) for row in ok]),
        engine_cpu_s=(None if any(c.engine_cpu_s is None for c in cells)
                      else sum(c.engine_cpu_s or 0.0 for c in cells)),
    )


def _record(row: Mapping[str, Any]) -> RequestRecord:
    """A ``per_request`` row back as a record (what :func:`_outcomes` reads of it)."""
    return RequestRecord(row["sent_s"], row["ttft_s"], row["latency_s"], row["prompt_tokens"],
                         0, row["cached_tokens"], plan=row.get("plan"),
                         predicted_ttft_s=row.get("predicted_ttft_s"),
                         rejected_pull_ttft_s=row.get("rejected_pull_ttft_s"))  # fmt: skip


def _sum_plans(plans: Sequence[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for each in plans:
        for reason, count in each.items():
            total[reason] = total.get(reason, 0) + count
    return total


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
        "plan": record.plan,
        "predicted_ttft_s": record.predicted_ttft_s,
        "rejected_pull_ttft_s": record.rejected_pull_ttft_s,
    }


BASELINES = ("none", "affinity", "vllm-p2p")
#: Arm over baseline: kvpeer against each baseline, and the tier alone (present, never
#: asked to pull: ``kvpeer-affinity``) against the same router with no tier (``affinity``).
PAIRS = (*(("kvpeer", b) for b in BASELINES), ("kvpeer-affinity", "affinity"))


def ratios(cells: Sequence[Cell], pairs: Sequence[tuple[str, str]] = PAIRS) -> list[Ratio]:
    """Each pair's arm's TTFT over its baseline's, per workload (and repeat) both ran: a
    repeat's cells are compared with the same repeat's, pooled with pooled."""
    by_key: Mapping[tuple[str, str, int | None], Cell] = {
        (c.arm, c.workload, c.repeat): c for c in cells
    }
    found: list[Ratio] = []
    for cell in cells:
        for arm, baseline in pairs:
            if cell.arm != arm:
                continue
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
                    _ratio(cell.ttft_mean_s, base.ttft_mean_s),
                    _ratio(cell.ttft_p90_s, base.ttft_p90_s),
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
              _median([r.ttft_p99 for r in group]), None,
              _median([r.ttft_mean for r in group]), _median([r.ttft_p90 for r in group]))
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
        f"{'workload':<17} {'arm':<15} {'n':>3} {'err':>3} {'load/s':>6} {'TTFT mean':>9} "
        f"{'p50':>7} {'p90':>7} {'p99':>7} {'req/s':>6} {'prompt':>7} {'hit own':>7} "
        f"{'hit ext':>7} {'pulls':>5} {'MiB':>6} {'named':>5} {'fell back':>9} {'CPU s':>6}"
    )
    lines = [header, "-" * len(header)]
    for c in sorted(cells, key=lambda c: (c.workload, c.arm)):
        lines.append(
            f"{c.workload:<17} {c.arm:<15} {c.requests:>3} {c.errors:>3} "
            f"{_num(c.offered_rate, 2):>6} {_ms(c.ttft_mean_s):>9} {_ms(c.ttft_p50_s):>7} "
            f"{_ms(c.ttft_p90_s):>7} {_ms(c.ttft_p99_s):>7} {_num(c.requests_per_s, 2):>6} "
            f"{c.prompt_tokens:>7} {_int(c.local_hit_tokens):>7} "
            f"{_int(c.external_hit_tokens):>7} {_int(c.pulls):>5} "
            f"{_mib(c.pulled_bytes):>6} {c.pulls_named:>5} {c.pulls_fell_back:>9} "
            f"{_num(c.engine_cpu_s, 0):>6}"
        )
    planned = [c for c in sorted(cells, key=lambda c: (c.workload, c.arm)) if c.plans]
    if planned:
        lines.append("")
        lines.append("router plans by reason")
        for c in planned:
            reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(c.plans.items()))
            lines.append(f"  {c.workload:<17} {c.arm:<15} {reasons}")
    judged = [c for c in sorted(cells, key=lambda c: (c.workload, c.arm))
              if c.outcomes and c.arm == "kvpeer"]  # fmt: skip
    if judged:
        lines.append("")
        lines.append("kvpeer's plans against outcomes (requests: mean TTFT predicted -> measured)")
        for c in judged:
            each = ", ".join(
                f"{reason} {int(o['n'])}: {_ms(o['predicted_mean_s'])} -> "
                f"{_ms(o['actual_mean_s'])}"
                + (f" (pull passed over: {_ms(o['rejected_pull_mean_s'])})"
                   if "rejected_pull_mean_s" in o else "")
                for reason, o in c.outcomes.items()
            )
            lines.append(f"  {c.workload:<17} {each}")
    found = ratios(cells)
    per_repeat = ratios(repeat_cells)
    repeats = len({c.repeat for c in repeat_cells})
    if found:
        lines.append("")
        pooled = f", {repeats} repeats pooled" if repeat_cells else ""
        lines.append(f"TTFT ratios (below 1: the arm is faster than its baseline{pooled})")
        for r in found:
            lines.append(
                f"  {r.workload:<17} {r.arm + '/' + r.baseline:<25} "
                f"mean {_times(r.ttft_mean):>6}  "
                f"p50 {_times(r.ttft_p50):>6}  p90 {_times(r.ttft_p90):>6}  "
                f"p99 {_times(r.ttft_p99):>6}"
            )
    if per_repeat:
        lines.append("")
        lines.append("TTFT ratios per turn (arms in turns, same seed within a turn), and "
                     "their median")
        medians = {(r.workload, r.arm, r.baseline): r for r in median_ratios(per_repeat)}
        for (workload, arm, baseline), median in medians.items():
            mine = [r for r in per_repeat if (r.workload, r.arm, r.baseline) == (workload, arm,
                                                                                baseline)]
            for name, pick in (("mean", attrgetter("ttft_mean")), ("p50", attrgetter("ttft_p50")),
                               ("p90", attrgetter("ttft_p90")),
                               ("p99", attrgetter("ttft_p99"))):  # fmt: skip
                each = " ".join(_times(pick(r)) for r in mine)
                lines.append(f"  {workload:<17} {arm + '/' + baseline:<25} {name:<4} {each}  "
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


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _int(value: int | None) -> str:
    return "-" if value is None else str(value)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.0f}"


def _times(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if value >= 0.01 else f"{value:.3f}x"  # 0.004x, not 0.00x
