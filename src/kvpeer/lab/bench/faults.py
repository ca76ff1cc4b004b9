"""``kvpeer bench faults``: what a producer's failure costs a consumer request, in real engines.

A producer/consumer pair of ``vllm serve`` engines per tier (kvpeer, vLLM's ``p2p``);
the producer runs the PD prefill leg, then a fault hits it and the consumer's
``remote_prefiller`` request names it. The **fallback time** is that request's latency
less the same request computed locally by the same consumer in the same run (a
``cache_salt`` keeps the local run from sharing blocks with it); the local run's tokens
are the reference every output must equal. This module is the pure part: faults and
their bounds, samples, statistics, the judge, the table. :mod:`kvpeer.lab.bench.faults_run`
drives the engines.

Bounds (issue 11, item 1): a producer that is gone before the request (SIGKILL, its
sockets closed: connects are refused), or backed off, costs at most
:data:`REFUSED_BOUND_S`; every other fault costs at most the request budget
(:data:`BUDGET_S`, 2 s; ``peer_wait_s`` is 1.5 s by default). That is a frozen producer
(SIGSTOP); one killed while a request waits on it: Linux tears a killed process's
memory down before it closes its files, so its sockets stay open and silent until then
(here 0.1-0.4 s for an EngineCore after its SIGKILL, 1.3-2.3 s for the whole engine,
``producer_gone_s`` in each sample), and the consumer sees the close when it comes or
gives up at its budget, whichever is first; and a restarted producer, which answers, but
as a fresh process: its first contact (both data-plane registrations, its first reads)
took 30-780 ms on this 2-core machine with both engines busy (median ~120 ms).
Only the kvpeer tier is judged; vLLM's tier is measured for comparison.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "BUDGET_S",
    "FAULTS",
    "REFUSED_BOUND_S",
    "TIERS",
    "Cell",
    "Fault",
    "FaultsSpec",
    "Renewal",
    "Sample",
    "add_arguments",
    "cells",
    "judge",
    "render",
    "to_json",
]

REFUSED_BOUND_S = 0.25  # connection refused, or the peer backed off: local at once
#: Any other fault: the request budget of issue 11. The default peer_wait_s (1.5 s)
#: leaves room in it for the engine step that sees the failure.
BUDGET_S = 2.0


@dataclass(frozen=True)
class Fault:
    name: str
    bound_s: float | None  # None: a control, not judged
    what: str


FAULTS: tuple[Fault, ...] = (
    Fault("healthy", None, "control: producer alive, the consumer pulls"),
    Fault(
        "killed-before-contact",
        REFUSED_BOUND_S,
        "SIGKILL after its prefill leg, before the consumer's request (refused connect)",
    ),
    Fault(
        "backed-off",
        REFUSED_BOUND_S,
        "the dead producer named again at once (the peer's back-off)",
    ),
    Fault(
        "killed-during-lookup",
        BUDGET_S,  # silent until the kernel closes its sockets (module docstring)
        "SIGSTOP before the consumer's request, SIGKILL 20-60 ms after it was sent",
    ),
    Fault(
        "killed-mid-transfer",
        BUDGET_S,
        "SIGKILL part-way into the consumer's pull (large prompt)",
    ),
    Fault(
        "frozen-first-contact",
        BUDGET_S,
        "SIGSTOP before the consumer ever contacted it; SIGCONT after",
    ),
    Fault(
        "frozen-in-session",
        BUDGET_S,
        "SIGSTOP while the consumer holds a session with it; SIGCONT after",
    ),
    Fault(
        "restarted",
        BUDGET_S,  # a fresh process's first contact (module docstring)
        "prefill leg on the old process, restarted on the same ports, then the request",
    ),
)
FAULT_NAMES = tuple(fault.name for fault in FAULTS)
TIERS = ("kvpeer", "p2p")
BY_NAME = {fault.name: fault for fault in FAULTS}


@dataclass(frozen=True)
class FaultsSpec:
    """What one ``kvpeer bench faults`` run measures; validated once, here."""

    runs: int = 5
    faults: tuple[str, ...] = FAULT_NAMES
    tiers: tuple[str, ...] = TIERS
    quick: bool = False

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise ValueError(f"--runs must be at least 1, got {self.runs}")
        unknown = sorted(set(self.faults) - set(FAULT_NAMES))
        if unknown:
            raise ValueError(f"--faults: unknown {unknown}; choose from {','.join(FAULT_NAMES)}")
        bad = sorted(set(self.tiers) - set(TIERS))
        if bad:
            raise ValueError(f"--tiers: unknown {bad}; choose from {','.join(TIERS)}")
        if not self.faults or not self.tiers:
            raise ValueError("--faults and --tiers need at least one entry")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultsSpec:
        runs = args.runs if args.runs is not None else (1 if args.quick else 5)
        return cls(
            runs=runs,
            faults=tuple(args.faults) if args.faults else FAULT_NAMES,
            tiers=tuple(args.tiers) if args.tiers else TIERS,
            quick=bool(args.quick),
        )


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, help="runs per fault and tier (default 5; quick 1)")
    parser.add_argument(
        "--faults", type=_csv, help=f"comma list (default all): {','.join(FAULT_NAMES)}"
    )
    parser.add_argument("--tiers", type=_csv, help="comma list (default kvpeer,p2p)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, short prompts, one run: a smoke test, not the numbers",
    )
    parser.add_argument(
        "--model",
        help="checkpoint directory (default ~/.cache/kvpeer/serve-llama; quick: tiny-llama)",
    )
    parser.add_argument("--log-dir", help="keep the engines' logs here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class Sample:
    """One fault run on one tier. ``fallback_s`` = ``latency_s`` - ``local_s``."""

    tier: str
    fault: str
    run: int
    latency_s: float
    local_s: float
    outputs_equal: bool
    cached_tokens: int = 0
    phase: str = ""  # what the consumer's kvpeer counters say it reached
    counters: dict[str, float] = field(default_factory=dict)
    error: str = ""
    producer_gone_s: float | None = None  # SIGKILL to the producer's last process gone

    @property
    def fallback_s(self) -> float:
        return self.latency_s - self.local_s


@dataclass(frozen=True)
class Renewal:
    """A pair started afresh after ``after`` (a fault run) because it pulled no more, or
    a tier's measurement stopped there (``why`` says which). On the kvpeer tier either is
    a failure of its own; vLLM's p2p pair needs them."""

    tier: str
    after: str
    why: str


@dataclass(frozen=True)
class Cell:
    """Every sample of one fault on one tier, summarised and judged."""

    tier: str
    fault: str
    runs: int
    median_s: float | None
    max_s: float | None
    outputs_equal: int  # runs whose output equals the local run
    errors: int
    bound_s: float | None
    phases: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def judge(tier: str, fault: str, samples: Sequence[Sample]) -> Cell:
    """Summarise ``samples``; every run must produce the local output, and on the kvpeer
    tier each fallback must be within the fault's bound (the max is what is judged)."""
    done = [s for s in samples if not s.error]
    fallbacks = [s.fallback_s for s in done]
    bound = BY_NAME[fault].bound_s
    problems: list[str] = []
    for sample in samples:
        if sample.error:
            problems.append(f"run {sample.run}: {sample.error}")
        elif not sample.outputs_equal:
            problems.append(f"run {sample.run}: output differs from the local run")
        elif tier == "kvpeer" and bound is not None and sample.fallback_s > bound:
            problems.append(
                f"run {sample.run}: fallback {sample.fallback_s:.3f} s > bound {bound:g} s"
                f" (phase {sample.phase or '?'})"
            )
    if tier != "kvpeer":  # measured for comparison: a slow fallback there is not ours
        problems = [p for p in problems if "bound" not in p]
    return Cell(
        tier=tier,
        fault=fault,
        runs=len(samples),
        median_s=statistics.median(fallbacks) if fallbacks else None,
        max_s=max(fallbacks) if fallbacks else None,
        outputs_equal=sum(1 for s in done if s.outputs_equal),
        errors=len(samples) - len(done),
        bound_s=bound if tier == "kvpeer" else None,
        phases=tuple(sorted({s.phase for s in done if s.phase})),
        problems=tuple(problems),
    )


def cells(samples: Iterable[Sample]) -> list[Cell]:
    """One judged cell per (fault, tier) that has samples, in FAULTS then TIERS order."""
    grouped: dict[tuple[str, str], list[Sample]] = {}
    for sample in samples:
        grouped.setdefault((sample.fault, sample.tier), []).append(sample)
    order = [(f, t) for f in FAULT_NAMES for t in TIERS]
    return [
        judge(tier, fault, grouped[(fault, tier)])
        for fault, tier in order
        if (fault, tier) in grouped
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def render(result: dict[str, Any]) -> str:
    """The table: one row per fault and tier."""
    header = (
        f"{'fault':<22} {'tier':<7} {'median':>9} {'max':>9} {'bound':>8} "
        f"{'runs':>4}  {'outputs':<9} {'verdict':<7} phase (consumer counters)"
    )
    lines = [header, "-" * len(header)]
    for cell in result["cells"]:
        bound = "-" if cell["bound_s"] is None else f"{cell['bound_s'] * 1000:.0f} ms"
        equal = f"{cell['outputs_equal']}/{cell['runs']}"
        verdict = "ok" if not cell["problems"] else "FAIL"
        lines.append(
            f"{cell['fault']:<22} {cell['tier']:<7} {_ms(cell['median_s']):>9} "
            f"{_ms(cell['max_s']):>9} {bound:>8} {cell['runs']:>4}  {equal:<9} {verdict:<7} "
            f"{' | '.join(cell['phases']) or '-'}"
        )
    problems = [f"{c['fault']}/{c['tier']}: {p}" for c in result["cells"] for p in c["problems"]]
    problems += [
        f"{r['tier']}: after {r['after']}: {r['why']}"
        for r in result.get("renewals", ())
        if r["tier"] == "kvpeer"
    ]
    renewed = [r for r in result.get("renewals", ()) if r["tier"] != "kvpeer"]
    if renewed:
        lines += ["", "fresh pairs and stops of vLLM's tier (not judged):"]
        lines += [f"  {r['tier']} after {r['after']}: {r['why']}" for r in renewed]
    if problems:
        lines += ["", "problems:", *(f"  {p}" for p in problems)]
    lines += [
        "",
        f"fallback = request latency - the same request computed locally, same run; "
        f"{result['runs']} run(s) per cell; model {result['model']}, prompt "
        f"{result['prompt_tokens']} tokens; {result['seconds']:.0f} s",
    ]
    return "\n".join(lines)


def to_json(
    spec: FaultsSpec,
    samples: Sequence[Sample],
    *,
    model: str,
    prompt_tokens: int,
    seconds: float,
    renewals: Sequence[Renewal] = (),
) -> dict[str, Any]:
    """The run as one object; ``ok`` needs every cell ok and no kvpeer pair renewed."""
    judged = cells(samples)
    return {
        "runs": spec.runs,
        "model": model,
        "prompt_tokens": prompt_tokens,
        "seconds": seconds,
        "ok": all(cell.ok for cell in judged) and not any(r.tier == "kvpeer" for r in renewals),
        "cells": [{**asdict(cell), "ok": cell.ok} for cell in judged],
        "renewals": [asdict(renewal) for renewal in renewals],
        "samples": [{**asdict(s), "fallback_s": s.fallback_s} for s in samples],
    }
