"""``kvpeer soak``: two real engines under mixed traffic and injected faults, then a verdict.

This module is the pure part: the arguments, the seeded fault schedule, what one request's
outcome is, the tallies, the resource comparison and the verdict, the summary. The
engines, routers, traffic and faults are driven by :mod:`kvpeer.lab.bench.soak_run`.

**Faults.** After warm-up, every ``--fault-every`` seconds on average (drawn uniformly
from 2/3 to 4/3 of it, seeded by ``--seed``; the gap runs from the end of the previous
fault) one of: ``kill-restart`` (SIGKILL of the engine's process group, then the engine
started again on the same ports), ``restart`` (SIGTERM, a clean exit, then started again
on the same ports), ``freeze`` (SIGSTOP of the group for 2-5 s, then SIGCONT). Kills and
restarts hit engine ``b`` only; freezes either engine. So engine ``a`` (:data:`WITNESS`)
lives from warm-up to the end, and its processes can be compared with themselves for
leaks; ``b`` is a new set of processes after every restart, and a new process cannot be
compared with the one it replaced.

**Resources.** Resident memory and open descriptors of every process alive both after
warm-up and at the end (same pid, same start time): the two ``kvpeer router`` processes
(:data:`ROUTERS`) and every process of an engine not restarted since warm-up. Each must be
within :data:`RESOURCE_TOLERANCE` (5 %) of its warm-up value (descriptors: or within
:data:`FD_SLACK`, whichever allows more). The memory judged is RSS
less shared-memory pages (``RssShmem``: an engine maps its own 256 MiB CPU region and,
over shm, its peer's, whose pages count as they are touched and are returned when the
peer's region is unmapped; a restarted peer brings a new one; shown beside). What is
judged is shown in its two parts as well: anonymous memory (``RssAnon``: heap, stacks,
what the process allocated, where a leak lives) and pages of mapped files (``RssFile``:
interpreter, libraries, the model's weights, resident as code first runs). Warm-up is
every path once, then :data:`WARMUP_TRAFFIC_S` of the soak's own traffic,
:data:`WARMUP_FAULT` (a SIGKILL and restart of ``b``: the failure paths, first taken at
the first fault, allocate what they keep once, and the routers relearn a new engine),
and :data:`WARMUP_TRAFFIC_S` more; that fault is logged apart and is not one of the
soak's. Both samples are taken with the traffic paused (no request in flight) and no
fault in progress. The driver (the soak's own process: traffic threads, clients, fault
injection) is the load generator: shown, not judged; its garbage is collected and its C
heap trimmed before each sample.

**Verdict.** Exit 1 if any output differs from its prompt's reference, a process grew
past the tolerance, a file is left in ``/dev/shm``, a request failed whose life does not
overlap a fault's window (from the injection until the engine answers ``/health`` again,
plus :data:`FAULT_GRACE_S`), or no request succeeded.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "FAULT_KINDS",
    "FD_SLACK",
    "RESOURCE_TOLERANCE",
    "WARMUP_FAULT",
    "WITNESS",
    "Fault",
    "Outcome",
    "ProcessRow",
    "SoakSpec",
    "Tally",
    "add_arguments",
    "classify",
    "compare_processes",
    "in_fault_window",
    "render",
    "schedule",
    "verdict",
]

FAULT_KINDS = ("kill-restart", "restart", "freeze")
ENGINES = ("a", "b")
WITNESS = "a"  # never killed nor restarted: its processes are compared for leaks
# Before each sample, with traffic paused: the routers close pooled engine connections
# idle for 15 s (aiohttp's keep-alive), so both samples count the same connections (the
# health checks keep one per engine) and not how many requests were in flight at the end.
QUIET_S = 16.0
DRIVER = "driver"  # the soak's own process: traffic threads and clients (not judged)
ROUTERS = ("shared", "pd")  # kvpeer router processes, judged like the engines' processes
RESOURCE_TOLERANCE = 0.05
#: Descriptors may also differ by this many, whichever allows more: the routers' and the
#: engines' connection pools hold a varying handful (keep-alive connections to an engine
#: restarted mid-soak, probes, scrapes), past soaks saw 85 -> 79 and 59 -> 54, and 5 % of
#: a router's ~34 is under two. A leak per request or per fault still shows: hundreds of
#: requests a minute, dozens of faults an hour.
FD_SLACK = 6
WARMUP_TRAFFIC_S = 30.0
FAULT_GRACE_S = 5.0  # after an engine is healthy again, the routers' health checks catch up
FREEZE_S = (2.0, 5.0)
DEFAULT_FAULT_EVERY_S = 15.0
BLOCK_TOKENS = 32


@dataclass(frozen=True)
class SoakSpec:
    """What one soak runs; validated here."""

    minutes: float
    fault_every_s: float = DEFAULT_FAULT_EVERY_S
    seed: int = 0
    trace_memory: bool = False

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"--minutes must be positive, got {self.minutes}")
        if not self.fault_every_s >= 1.0:
            raise ValueError(f"--fault-every must be at least 1 second, got {self.fault_every_s}")

    @property
    def seconds(self) -> float:
        return self.minutes * 60.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SoakSpec:
        return cls(
            minutes=args.minutes,
            fault_every_s=args.fault_every,
            seed=args.seed,
            trace_memory=bool(getattr(args, "trace_memory", False)),
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes", type=float, required=True, help="how long traffic and faults run"
    )
    parser.add_argument(
        "--fault-every",
        type=float,
        default=DEFAULT_FAULT_EVERY_S,
        help=f"mean seconds between faults (default {DEFAULT_FAULT_EVERY_S:g}: 10-20 s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the faults and the traffic")
    parser.add_argument(
        "--model", help="checkpoint directory (default ~/.cache/kvpeer/serve-llama)"
    )
    parser.add_argument("--log-dir", help="keep the engines' logs here (default: kept on failure)")
    parser.add_argument(
        "--trace-memory",
        action="store_true",
        help="trace the driver's allocations (tracemalloc) and report where its memory "
        "grew between the two samples (slower; for finding a leak)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class Fault:
    """One fault: ``gap_s`` after the previous one was over, ``kind`` on ``engine``."""

    gap_s: float
    kind: str
    engine: str
    freeze_s: float = 0.0


def schedule(seed: int, every_s: float) -> Iterator[Fault]:
    """The endless seeded fault sequence (the run takes as many as fit)."""
    rng = random.Random(seed)
    while True:
        gap = rng.uniform(every_s * 2 / 3, every_s * 4 / 3)
        kind = rng.choice(FAULT_KINDS)
        if kind == "freeze":
            yield Fault(gap, kind, rng.choice(ENGINES), round(rng.uniform(*FREEZE_S), 2))
        else:
            yield Fault(gap, kind, "b")


WARMUP_FAULT = Fault(0.0, "kill-restart", "b")


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it. ``named_peer``: the router named a peer to pull
    from (PD: always, the decode engine is to pull the prompt; without a prefill leg it
    computes it, a fallback); ``cached``: prompt tokens the engine did not compute."""

    kind: str  # "pd" | "shared"
    started_s: float  # since the soak's start
    error: str = ""
    ended_s: float | None = None  # None: at once
    matched: bool = False
    named_peer: bool = False
    cached: int = 0


def classify(outcome: Outcome) -> str:
    """``failed`` (no answer), ``mismatch`` (an answer unlike the reference), ``fallback``
    (right, but a named peer gave nothing: the prompt was computed), else ``ok``."""
    if outcome.error:
        return "failed"
    if not outcome.matched:
        return "mismatch"
    if outcome.named_peer and outcome.cached < BLOCK_TOKENS:
        return "fallback"
    return "ok"


@dataclass
class Tally:
    """Counts per request kind and class; failures outside fault windows by message."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    from_cache: int = 0  # ok requests whose prompt was (mostly) not computed
    unexplained: list[str] = field(default_factory=list)  # failures outside fault windows

    def add(self, outcome: Outcome, windows: Sequence[tuple[float, float]]) -> str:
        label = classify(outcome)
        by_class = self.counts.setdefault(outcome.kind, {})
        by_class[label] = by_class.get(label, 0) + 1
        if label == "ok" and outcome.cached >= BLOCK_TOKENS:
            self.from_cache += 1
        ended = outcome.started_s if outcome.ended_s is None else outcome.ended_s
        outside = label == "failed" and not in_fault_window(outcome.started_s, windows, ended)
        if outside and len(self.unexplained) < 20:  # keep the driver's memory flat
            self.unexplained.append(
                f"{outcome.kind} at {outcome.started_s:.1f} s: {outcome.error[:200]}"
            )
        return label

    def total(self, label: str) -> int:
        return sum(by_class.get(label, 0) for by_class in self.counts.values())


def in_fault_window(
    at_s: float, windows: Sequence[tuple[float, float]], until_s: float | None = None
) -> bool:
    """Whether ``[at_s, until_s]`` (a request's life) meets a fault window; an open
    window ends at infinity."""
    last = at_s if until_s is None else until_s
    return any(start <= last and at_s <= end for start, end in windows)


@dataclass(frozen=True)
class ProcessRow:
    """One process sampled after warm-up and at the end."""

    label: str  # "driver", "a:VLLM::EngineCor", ...
    pid: int
    anon_before: int  # anonymous resident memory (RssAnon)
    anon_after: int | None  # None: gone or replaced (a restarted engine)
    fds_before: int
    fds_after: int | None
    judged: bool
    file_before: int = 0  # resident pages of mapped files (RssFile)
    file_after: int | None = None
    shmem_before: int = 0  # shared-memory pages (RssShmem): shown, not judged
    shmem_after: int | None = None
    unjudged_why: str = ""  # "restarted", "load generator"

    @property
    def rss_before(self) -> int:
        """Judged: RSS less shared memory (anonymous and file pages)."""
        return self.anon_before + self.file_before

    @property
    def rss_after(self) -> int | None:
        if self.anon_after is None or self.file_after is None:
            return None
        return self.anon_after + self.file_after

    @property
    def rss_growth(self) -> float | None:
        return _growth(self.rss_before, self.rss_after)

    @property
    def anon_growth(self) -> float | None:
        return _growth(self.anon_before, self.anon_after)

    @property
    def file_growth(self) -> float | None:
        return _growth(self.file_before, self.file_after)

    @property
    def fds_growth(self) -> float | None:
        return _growth(self.fds_before, self.fds_after)

    def problems(self) -> list[str]:
        if not self.judged:
            return []
        rss_after = self.rss_after
        if rss_after is None or self.fds_after is None:
            return [f"{self.label} (pid {self.pid}) is gone"]
        out = []
        if rss_after > self.rss_before * (1 + RESOURCE_TOLERANCE):
            out.append(
                f"{self.label} (pid {self.pid}) private RSS {_mib(self.rss_before)} -> "
                f"{_mib(rss_after)} (> {RESOURCE_TOLERANCE:.0%}; anonymous "
                f"{_mib(self.anon_before)} -> {_mib(self.anon_after or 0)})"
            )
        if self.fds_after > max(self.fds_before * (1 + RESOURCE_TOLERANCE),
                                self.fds_before + FD_SLACK):  # fmt: skip
            out.append(
                f"{self.label} (pid {self.pid}) fds {self.fds_before} -> "
                f"{self.fds_after} (> {RESOURCE_TOLERANCE:.0%} and > {FD_SLACK} more)"
            )
        return out


def _growth(before: int, after: int | None) -> float | None:
    if after is None or not before:
        return None
    return after / before - 1.0


# label, pid, started, anonymous rss, file rss, shmem rss, fds
Sample = tuple[str, int, int, int, int, int, int]


def compare_processes(
    before: Sequence[Sample], after: Sequence[Sample], restarted: set[str]
) -> list[ProcessRow]:
    """Pair each warm-up sample with the same process at the end (pid and start time).
    Processes of engines in ``restarted`` are shown but not judged (they were replaced),
    and so is the driver: the load generator, whose clients are not kvpeer (the routers
    run as processes of their own and are judged)."""
    now = {(pid, started): rest for _label, pid, started, *rest in after}
    rows = []
    for label, pid, started, anon, file, shm, fds in before:
        engine = label.split(":", 1)[0]
        later = now.get((pid, started))
        why = "restarted" if engine in restarted else "load generator" if label == DRIVER else ""
        rows.append(
            ProcessRow(
                label,
                pid,
                anon,
                later[0] if later else None,
                fds,
                later[3] if later else None,
                judged=not why,
                file_before=file,
                file_after=later[1] if later else None,
                shmem_before=shm,
                shmem_after=later[2] if later else None,
                unjudged_why=why,
            )
        )
    return rows


def verdict(
    tally: Tally, rows: Sequence[ProcessRow], leftovers: Sequence[str], faults: int
) -> list[str]:
    """Every reason the soak failed (empty: it passed)."""
    problems: list[str] = []
    mismatches = tally.total("mismatch")
    if mismatches:
        problems.append(f"{mismatches} output(s) differ from their reference")
    if not tally.total("ok") + tally.total("fallback"):
        problems.append("no request succeeded")
    for row in rows:
        problems.extend(row.problems())
    if leftovers:
        problems.append(f"left in /dev/shm: {', '.join(leftovers)}")
    problems.extend(f"failed outside a fault window: {u}" for u in tally.unexplained)
    if faults == 0:
        problems.append("no fault was injected (run longer or lower --fault-every)")
    return problems


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def summary(
    *,
    spec: SoakSpec,
    tally: Tally,
    rows: Sequence[ProcessRow],
    faults: Sequence[dict[str, Any]],
    pulled_blocks: float,
    leftovers: Sequence[str],
    removed_by_fleet: Sequence[str],
    seconds: float,
    logs: Sequence[str],
    warmup_faults: Sequence[dict[str, Any]] = (),
    event_history: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ``--json`` object (the table renders it)."""
    problems = verdict(tally, rows, leftovers, len(faults))
    by_kind: dict[str, int] = {}
    for fault in faults:
        by_kind[fault["kind"]] = by_kind.get(fault["kind"], 0) + 1
    return {
        "ok": not problems,
        "minutes": spec.minutes,
        "seed": spec.seed,
        "fault_every_s": spec.fault_every_s,
        "seconds": round(seconds, 1),
        "requests": tally.counts,
        "requests_from_cache_or_peer": tally.from_cache,
        "mismatches": tally.total("mismatch"),
        "faults": by_kind,
        "fault_log": list(faults),
        "warmup_fault_log": list(warmup_faults),
        "pulled_blocks": pulled_blocks,
        "processes": [
            {
                **asdict(row),
                "rss_before": row.rss_before,
                "rss_after": row.rss_after,
                "rss_growth": row.rss_growth,
                "anon_growth": row.anon_growth,
                "file_growth": row.file_growth,
                "fds_growth": row.fds_growth,
            }
            for row in rows
        ],
        "leftovers": list(leftovers),
        "removed_by_fleet": list(removed_by_fleet),
        "event_history": {name: dict(h) for name, h in (event_history or {}).items()},
        "problems": problems,
        "logs": list(logs),
    }


def render(result: dict[str, Any]) -> str:
    """The summary as text: requests, faults, processes, files, verdict."""
    lines = [f"{'requests':<10} {'ok':>6} {'fallback':>9} {'failed':>7} {'mismatch':>9}"]
    for kind, by_class in sorted(result["requests"].items()):
        lines.append(
            f"{kind:<10} {by_class.get('ok', 0):>6} {by_class.get('fallback', 0):>9} "
            f"{by_class.get('failed', 0):>7} {by_class.get('mismatch', 0):>9}"
        )
    faults = ", ".join(f"{n} {kind}" for kind, n in sorted(result["faults"].items())) or "none"
    warmup = ", ".join(
        f"{f['kind']} of {f['engine']} ({f['seconds']:.0f} s)"
        for f in result.get("warmup_fault_log", [])
    )
    lines += [
        f"served from cache or a peer: {result['requests_from_cache_or_peer']}; "
        f"blocks pulled (engines' /metrics): {result['pulled_blocks']:.0f}",
        f"faults: {faults}" + (f" (and in warm-up, before the first sample: {warmup})"
                               if warmup else ""),
        "",
        f"{'process':<22} {'pid':>7} {'private RSS':>11} {'end':>10} {'':>7} "
        f"{'anon':>7} {'file':>7} {'fds':>4} {'end':>4} {'':>7} {'shm RSS':>10} {'end':>10}"
        "  judged",
    ]
    for row in result["processes"]:
        rss_g, anon_g, file_g, fds_g = (
            "-" if row[k] is None else f"{row[k]:+.1%}"
            for k in ("rss_growth", "anon_growth", "file_growth", "fds_growth")
        )
        rss_after, shm_after = (
            "-" if row[k] is None else _mib(row[k]) for k in ("rss_after", "shmem_after")
        )
        fds_after = "-" if row["fds_after"] is None else str(row["fds_after"])
        lines.append(
            f"{row['label']:<22} {row['pid']:>7} {_mib(row['rss_before']):>11} "
            f"{rss_after:>10} {rss_g:>7} {anon_g:>7} {file_g:>7} {row['fds_before']:>4} "
            f"{fds_after:>4} {fds_g:>7} {_mib(row['shmem_before']):>10} {shm_after:>10}  "
            f"{'yes' if row['judged'] else 'no (' + row.get('unjudged_why', '') + ')'}"
        )
    lines += [
        "",
        f"left in /dev/shm after the fleet closed: {len(result['leftovers'])}; removed by "
        f"the fleet (vLLM's files of killed groups): {len(result['removed_by_fleet'])}",
    ]
    lines += [f"problem: {p}" for p in result["problems"]]
    verdict_word = "ok" if result["ok"] else "FAILED"
    lines.append(
        f"kvpeer soak {verdict_word}: {result['minutes']:g} min, seed {result['seed']}, "
        f"{sum(result['faults'].values())} faults, {result['seconds']:.0f} s in all"
    )
    if result["logs"]:
        lines.append("engine logs: " + " ".join(result["logs"]))
    return "\n".join(lines)
