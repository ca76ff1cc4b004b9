"""``kvpeer bench serve``: time to first token under a workload, per fleet.

For each **arm** two fresh ``vllm serve`` engines start and a ``kvpeer router`` goes in
front of them (the same router code and the same ``kv_transfer_params`` for every arm):

=============== ================================= ====================================
arm             engines' secondary tier           router policy
=============== ================================= ====================================
none            none                              pull (pinned workloads only)
affinity        none (CPU tier only)              affinity: KV events, never pulls
load            none (CPU tier only)              load only
kvpeer          kvpeer, as the README starts it   pull: KV events, pulls when faster
kvpeer-affinity kvpeer, as the README starts it   affinity: the tier present, never
                                                  asked to pull (what the tier costs)
vllm-p2p        vLLM 0.32's own ``p2p`` tier      pull
=============== ================================= ====================================

With ``--repeat N`` the arms run in turns (A B C, A B C, ...): turn ``k`` runs each arm,
on fresh engines, on seed ``seed + k`` one after another, so a ratio compares arms
measured minutes apart on the same requests; the median of the per-turn ratios is the
result (this machine drifts by tens of percent between runs).

Every chosen workload (:mod:`kvpeer.lab.bench.serve_workloads`) is driven through the
routers' OpenAI API (:mod:`kvpeer.lab.bench.serve_client`). *Unpinned* workloads (``prefix``,
``chat``, ``chat-skewed``: the router places every request, as for users) are sent with
vLLM's benchmark request function at two offered loads, one below saturation and one near
it, found by a short probe on the first arm (:func:`probe_loads`) or given with
``--loads``; they run on every arm but ``none``. *Pinned* workloads place each request
themselves (a pull's cost per tier, not the router's choice) and run on ``none``,
``kvpeer`` and ``vllm-p2p``. The same seed gives every arm the same requests. Numbers per
arm x workload and the ratios between arms come from :mod:`kvpeer.lab.bench.serve_stats`.

The matrix runner (:func:`run_matrix`) only needs an :data:`OpenArm`: a context manager
per arm yielding the routers' URLs and the fleet's counters.
:class:`~kvpeer.lab.bench.serve_vllm.VllmArms` is the real one; tests pass fakes (fake
engines behind the real router), so everything but ``vllm serve`` itself is tested fast.

An arm that cannot run here (vLLM's tier needs NIXL; engines that fail to start) is
reported with its reason and the other arms still run. The real arms live in
:mod:`kvpeer.lab.bench.serve_vllm`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from kvpeer.errors import ConfigError
from kvpeer.lab.bench.serve_client import run_phase
from kvpeer.lab.bench.serve_stats import (
    ArmError,
    Cell,
    FleetCounters,
    PeerCounters,
    RequestRecord,
    median_ratios,
    pool,
    ratios,
    summarize,
)
from kvpeer.lab.bench.serve_workloads import (
    BLOCK_TOKENS,
    MAX_CONTEXT,
    UNPINNED,
    WORKLOADS,
    Shape,
    Workload,
    build,
)

__all__ = [
    "ARMS",
    "ARM_POLICIES",
    "FULL_SHAPE",
    "QUICK_SHAPE",
    "ArmFleet",
    "ArmUnavailable",
    "BenchResult",
    "OpenArm",
    "ServeBenchSpec",
    "add_arguments",
    "probe_loads",
    "run_matrix",
]

ARMS = ("none", "affinity", "load", "kvpeer", "kvpeer-affinity", "vllm-p2p")
ARM_TIERS = {"none": "none", "affinity": "none", "load": "none", "kvpeer": "kvpeer",
             "kvpeer-affinity": "kvpeer", "vllm-p2p": "p2p"}  # fmt: skip
ARM_POLICIES = {"none": "pull", "affinity": "affinity", "load": "load", "kvpeer": "pull",
                "kvpeer-affinity": "affinity", "vllm-p2p": "pull"}  # fmt: skip
UNPINNED_ARMS = ("affinity", "load", "kvpeer", "kvpeer-affinity", "vllm-p2p")
PINNED_ARMS = ("none", "kvpeer", "vllm-p2p")
LEVELS = ("low", "high")  # the two offered loads of an unpinned workload
#: The offered loads, as fractions of the fleet's capacity the probe measured.
LOAD_FRACTIONS = (0.4, 0.85)
PROBE_REQUESTS = 8  # sent at once per unpinned workload (fewer if the shape has fewer)
DATA_PLANES = ("shm", "tcp", "nixl")
FULL_SHAPE = Shape(
    requests=24, rate=1.0, prompt_tokens=1536, suffix_tokens=128, output_tokens=16,
    turns=3, background_tokens=1536, think_s=1.0,
)  # fmt: skip
QUICK_SHAPE = Shape(
    requests=6, rate=2.0, prompt_tokens=1024, suffix_tokens=64, output_tokens=8,
    turns=3, background_tokens=1024, think_s=0.5, prefixes=2,
)  # fmt: skip
MAX_REPEATS = 20
INDEX_WAIT_S = 15.0  # a setup phase's prefixes must reach the router's index by then
KV_BYTES_PER_TOKEN = 24 * 1024  # the serving model's KV per token (float32)

Progress = Callable[[str], None]
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeBenchSpec:
    """Everything a run needs, validated here; every bad value is named."""

    arms: tuple[str, ...] = ARMS
    workloads: tuple[str, ...] = UNPINNED
    shape: Shape = FULL_SHAPE
    seed: int = 0
    data_plane: str = "shm"
    trace: bool = False  # engines and routers trace requests (kvpeer.lab.bench.serve_trace)
    #: every engine's ``--max-num-batched-tokens`` (None: vLLM's default, 2,048 on CPU)
    step_tokens: int | None = None
    #: turns: each arm runs every workload once per turn, turn ``k`` with seed ``seed + k``
    repeats: int = 1
    #: unpinned workloads' offered loads (requests/s, low and high); None: probe for them
    loads: tuple[float, float] | None = None
    #: the kvpeer arm's tiers obey its router's prefetches (kvpeer.node.ahead)
    ahead: bool = True

    def __post_init__(self) -> None:
        _check_names("--arms", self.arms, ARMS)
        _check_names("--workloads", self.workloads, WORKLOADS)
        if not any(arm_runs(arm, name) for arm in self.arms for name in self.workloads):
            raise ConfigError(
                f"--arms {','.join(self.arms)} with --workloads {','.join(self.workloads)}: "
                f"nothing to run (unpinned workloads run on {', '.join(UNPINNED_ARMS)}; "
                f"pinned ones on {', '.join(PINNED_ARMS)})"
            )
        if self.loads is not None:
            low, high = self.loads
            if not all(math.isfinite(x) and x > 0 for x in self.loads) or not low < high:
                raise ConfigError(
                    f"--loads {low:g},{high:g}: two positive requests/s, the first lower"
                )
        if self.data_plane not in DATA_PLANES:
            raise ConfigError(
                f"--data-plane {self.data_plane!r}: choose one of {', '.join(DATA_PLANES)}"
            )
        if self.step_tokens is not None and not BLOCK_TOKENS <= self.step_tokens <= MAX_CONTEXT:
            raise ConfigError(
                f"--max-num-batched-tokens {self.step_tokens}: must be "
                f"{BLOCK_TOKENS}..{MAX_CONTEXT} (one block up to the engines' context)"
            )
        if not 1 <= self.repeats <= MAX_REPEATS:
            raise ConfigError(f"--repeat {self.repeats}: must be 1..{MAX_REPEATS}")
        s = self.shape
        if s.requests < 1:
            raise ConfigError(f"--requests {s.requests}: must be at least 1")
        if not (math.isfinite(s.rate) and s.rate > 0):
            raise ConfigError(f"--rate {s.rate}: must be a positive number of requests/s")
        if not 1 <= s.suffix_tokens < s.prompt_tokens:
            raise ConfigError(
                f"suffix tokens {s.suffix_tokens}: must be 1..{s.prompt_tokens - 1} (below "
                "the prompt tokens: chat-skewed's openings are the rest of its first turn)"
            )
        if s.turns < 2:
            raise ConfigError(f"chat turns {s.turns}: must be at least 2")
        if s.prompt_tokens < 2 * BLOCK_TOKENS:
            raise ConfigError(
                f"prompt tokens {s.prompt_tokens}: must be at least {2 * BLOCK_TOKENS}"
            )
        longest = max(
            s.chat_tokens(),
            s.prompt_tokens + s.suffix_tokens + s.output_tokens,
            s.background_tokens + 1,
        )
        if longest >= MAX_CONTEXT:
            raise ConfigError(
                f"prompt tokens {s.prompt_tokens}: the longest request ({longest} tokens with "
                f"its output) must fit the engines' {MAX_CONTEXT}-token context"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeBenchSpec:
        shape = QUICK_SHAPE if args.quick else FULL_SHAPE
        if args.requests is not None:
            shape = replace(shape, requests=args.requests)
        if args.rate is not None:
            shape = replace(shape, rate=args.rate)
        return cls(
            arms=ARMS if args.arms is None else tuple(args.arms),
            workloads=UNPINNED if args.workloads is None else tuple(args.workloads),
            shape=shape,
            seed=args.seed,
            data_plane=args.data_plane,
            trace=args.trace,
            step_tokens=args.max_num_batched_tokens,
            repeats=args.repeat,
            loads=args.loads,
            ahead=args.ahead,
        )

    def engine_args(self) -> tuple[str, ...]:
        """Flags every engine of every arm gets."""
        if self.step_tokens is None:
            return ()
        return ("--max-num-batched-tokens", str(self.step_tokens))

    def cpu_bytes(self) -> int:
        """Each engine's CPU tier: room for every prefix busy-producer parks on ``a`` plus
        the background prefills that follow them (which would otherwise evict the
        prefixes before ``b`` pulls them), and some slack."""
        s = self.shape
        tokens = s.requests * (s.prompt_tokens + s.background_tokens + s.suffix_tokens)
        return tokens * KV_BYTES_PER_TOKEN + (256 << 20)


def arm_runs(arm: str, workload: str) -> bool:
    """Whether ``arm`` runs ``workload`` (unpinned ones on every arm with a router that
    places requests; pinned ones where the tier, not the placement, differs)."""
    return arm in (UNPINNED_ARMS if workload in UNPINNED else PINNED_ARMS)


def _check_names(flag: str, given: Sequence[str], known: Sequence[str]) -> None:
    if not given:
        raise ConfigError(f"{flag}: name at least one of {', '.join(known)}")
    unknown = [name for name in given if name not in known]
    if unknown:
        raise ConfigError(f"{flag}: unknown {', '.join(map(repr, unknown))}; "
                          f"choose from {', '.join(known)}")
    repeated = sorted({name for name in given if given.count(name) > 1})
    if repeated:
        raise ConfigError(f"{flag}: {', '.join(map(repr, repeated))} given twice")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def names(text: str) -> list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]

    def loads(text: str) -> tuple[float, float]:
        parts = text.split(",")
        try:
            low, high = (float(part) for part in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected LOW,HIGH in requests/s, e.g. 0.3,0.8"
            ) from None
        return low, high

    parser.add_argument("--arms", type=names,
                        help=f"comma-separated, of {','.join(ARMS)} (default: all; an arm "
                             "runs only the workloads it applies to)")
    parser.add_argument("--workloads", type=names,
                        help=f"comma-separated, of {','.join(WORKLOADS)} (default: the "
                             f"unpinned ones, {','.join(UNPINNED)})")
    parser.add_argument("--requests", type=int,
                        help="measured requests per workload and load (default 24; --quick 6)")
    parser.add_argument("--rate", type=float,
                        help="pinned workloads' Poisson arrivals per second (default 1; "
                             "--quick 2)")
    parser.add_argument("--loads", type=loads, metavar="LOW,HIGH",
                        help="unpinned workloads' two offered loads in requests/s (default: "
                             f"{LOAD_FRACTIONS[0]:g} and {LOAD_FRACTIONS[1]:g} of the capacity "
                             "a probe measures on the first arm)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="N turns, the arms in turns within each (A B A B ..., fresh "
                             "engines each), turn k on seed S+k (default 1); the table pools "
                             "the turns, then each turn's ratios and their median")
    parser.add_argument("--quick", action="store_true",
                        help="few requests, 1,024-token prompts (5-8 minutes for 3 arms here)")
    parser.add_argument("--data-plane", default="shm",
                        help="kvpeer's data plane: shm (default), tcp or nixl")
    parser.add_argument("--model",
                        help="checkpoint directory (default ~/.cache/kvpeer/serve-llama)")
    parser.add_argument("--log-dir", help="keep the engines' logs here (default: kept on failure)")
    parser.add_argument("--plot", help="write the TTFT CDFs (one panel per workload) to this PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                        help="every engine's step budget in tokens, all arms alike (default: "
                             "vLLM's, 2,048 on CPU); smaller steps let a short request "
                             "through sooner while another's long prefill is chunked")
    parser.add_argument("--no-ahead", dest="ahead", action="store_false",
                        help="the kvpeer arm does not pull ahead (its router sends no "
                             "prefetch; by default its tiers obey them)")  # fmt: skip
    parser.add_argument("--trace", action="store_true",
                        help="trace requests (KVPEER_TRACE=1) and print the slowest kvpeer "
                             "request's timeline per workload")


class ArmUnavailable(Exception):
    """This arm cannot run here (the message says why); the others still run."""


class ArmFleet(Protocol):
    """One arm's running engines behind its routers."""

    @property
    def urls(self) -> Mapping[str, str]:
        """Router kind (``shared``, ``pd``) → its base URL."""
        ...

    def counters(self) -> PeerCounters | None:
        """kvpeer's counters summed over the engines (None: the arm has no kvpeer tier)."""
        ...

    def fleet_counters(self) -> FleetCounters:
        """The engines' prefix-cache hits and the shared router's plans by reason."""
        ...

    def wait_indexed(self, held: Sequence[tuple[str, Sequence[int]]], timeout_s: float) -> None:
        """Wait (bounded) until the router knows each engine holds its prompt."""
        ...


OpenArm = Callable[[str], AbstractContextManager[ArmFleet]]
#: Told each cell's measured records (arm, workload, records): ``--trace`` picks from them.
Observe = Callable[[str, str, Sequence[RequestRecord]], None]


@dataclass(frozen=True)
class BenchResult:
    spec: ServeBenchSpec
    cells: list[Cell]  # one per arm x workload (pooled over the repeats)
    errors: list[ArmError]
    seconds: float
    logs: str | None = None
    setup_errors: list[str] = field(default_factory=list)
    timelines: list[str] = field(default_factory=list)  # --trace: rendered, one per line
    repeat_cells: list[Cell] = field(default_factory=list)  # --repeat N > 1: each repeat's
    #: unpinned workload -> its offered loads (low, high), probed or given
    loads: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.setup_errors and all(c.errors == 0 for c in self.cells)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seconds": round(self.seconds, 1),
            "spec": {**asdict(self.spec), "shape": asdict(self.spec.shape)},
            "loads": {name: list(pair) for name, pair in self.loads.items()},
            "cells": [c.to_json() for c in self.cells],
            "ratios": [asdict(r) for r in ratios(self.cells)],
            "repeat_cells": [c.to_json() for c in self.repeat_cells],
            "repeat_ratios": [asdict(r) for r in ratios(self.repeat_cells)],
            "median_ratios": [asdict(r) for r in median_ratios(ratios(self.repeat_cells))],
            "arms_not_run": [asdict(e) for e in self.errors],
            "setup_errors": self.setup_errors,
            "logs": self.logs,
            "timelines": self.timelines,
        }


def run_matrix(spec: ServeBenchSpec, open_arm: OpenArm, progress: Progress,
               observe: Observe | None = None, tokenizer: Any = None) -> BenchResult:
    """Every turn x every arm x every workload it runs: turn ``k`` runs each arm in order
    on seed ``spec.seed + k``, fresh engines each (started, measured, stopped before the
    next arm starts: two CPU fleets of this bench's size do not fit one 24 GiB machine
    beside a third), so drift over the run falls on every arm alike. Unpinned workloads
    run at both offered loads (probed on the first arm that runs them, unless given).
    ``tokenizer``: the served model's (the ``prefix`` workload needs it)."""
    started = time.monotonic()
    loads: dict[str, tuple[float, float]] = {}
    if spec.loads is not None:
        loads = {name: spec.loads for name in spec.workloads if name in UNPINNED}
    cells: list[Cell] = []
    errors: list[ArmError] = []
    setup_errors: list[str] = []
    runs: list[tuple[str, list[str]]] = []
    for arm in spec.arms:
        names = [name for name in spec.workloads if arm_runs(arm, name)]
        if names:
            runs.append((arm, names))
        else:
            progress(f"arm {arm}: none of the chosen workloads applies to it; not started")

    def turn(arm: str, names: list[str], fleet: ArmFleet, k: int) -> None:
        for name in names:
            if name in UNPINNED and name not in loads:
                loads[name] = probe_loads(name, spec, fleet, progress, tokenizer)
        tag = f" (turn {k + 1}/{spec.repeats})" if spec.repeats > 1 else ""
        for workload, rate in _workloads(spec, names, loads, k, tokenizer):
            cell, failed = _run_workload(arm, workload, fleet, progress, observe, tag, rate)
            cells.append(replace(cell, repeat=k))
            setup_errors.extend(failed)

    def failed(arm: str, exc: Exception) -> None:
        if isinstance(exc, ArmUnavailable):
            progress(f"arm {arm} did not run: {exc}")
            errors.append(ArmError(arm, str(exc)))
            return
        log.exception("arm %s failed", arm)  # one arm's failure must not lose the others'
        reason = f"failed: {type(exc).__name__}: {exc}".rstrip(": ")
        progress(f"arm {arm} {reason}")
        errors.append(ArmError(arm, reason))

    stopped: set[str] = set()
    for k in range(spec.repeats):
        for arm, names in runs:
            if arm in stopped:
                continue
            try:
                with open_arm(arm) as fleet:
                    turn(arm, names, fleet, k)
            except Exception as exc:  # the arm stops; the others go on
                failed(arm, exc)
                stopped.add(arm)
    seconds = time.monotonic() - started
    if spec.repeats == 1:
        return BenchResult(spec, cells, errors, seconds, setup_errors=setup_errors,
                           loads=loads)  # fmt: skip
    groups: dict[tuple[str, str], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.arm, cell.workload), []).append(cell)
    pooled = [pool(group) for group in groups.values()]
    return BenchResult(spec, pooled, errors, seconds, setup_errors=setup_errors,
                       repeat_cells=cells, loads=loads)  # fmt: skip


def _workloads(
    spec: ServeBenchSpec, names: Sequence[str], loads: Mapping[str, tuple[float, float]],
    repeat: int, tokenizer: Any,
) -> list[tuple[Workload, float | None]]:
    """The workloads of one repeat, each unpinned one at both loads (``name@level``)."""
    seed = spec.seed + repeat
    out: list[tuple[Workload, float | None]] = []
    for name in names:
        if name not in UNPINNED:
            out.append((build(name, spec.shape, seed), None))
            continue
        for level, rate in zip(LEVELS, loads[name], strict=True):
            shape = replace(spec.shape, rate=rate)
            workload = build(name, shape, seed, variant=level, tokenizer=tokenizer)
            out.append((replace(workload, name=f"{name}@{level}"), rate))
    return out


def probe_loads(
    name: str, spec: ServeBenchSpec, fleet: ArmFleet, progress: Progress, tokenizer: Any
) -> tuple[float, float]:
    """The two offered loads of unpinned workload ``name``: :data:`LOAD_FRACTIONS` of the
    fleet's capacity, measured by sending a few of its requests (a seed of their own, so
    nothing measured later was cached by the probe) at once, as vLLM's client sends them."""
    workload = build(name, spec.shape, spec.seed, variant="probe", tokenizer=tokenizer)
    count = min(PROBE_REQUESTS, len(workload.measured))
    requests = [replace(r, at_s=0.0, after=None, think_s=0.0) for r in workload.measured[:count]]
    progress(f"probe {name}: {count} requests at once, to measure the fleet's capacity")
    records = asyncio.run(run_phase(requests, fleet.urls, sender="vllm"))
    ok = [r for r in records if r.error is None]
    if not ok:
        raise ArmUnavailable(f"probe {name}: every request failed ({records[0].error})")
    window = max(r.done_s for r in ok) - min(r.sent_s for r in ok)
    capacity = len(ok) / max(window, 1e-3)
    low, high = (round(fraction * capacity, 3) for fraction in LOAD_FRACTIONS)
    progress(f"probe {name}: {len(ok)} requests answered in {window:.1f} s, capacity "
             f"{capacity:.2f} requests/s; offered loads {low:g} (low) and {high:g} (high)")
    return low, high


def _run_workload(
    arm: str, workload: Workload, fleet: ArmFleet, progress: Progress, observe: Observe | None,
    tag: str = "", rate: float | None = None,
) -> tuple[Cell, list[str]]:
    failed: list[str] = []
    if workload.setup:
        progress(f"{arm}/{workload.name}{tag}: setup, {len(workload.setup)} requests")
        records = asyncio.run(run_phase(workload.setup, fleet.urls))
        failed = [f"{arm}/{workload.name} setup: {r.error}" for r in records if r.error]
        held = [(r.pin, r.prompt) for r in workload.setup if r.pin is not None]
        fleet.wait_indexed(held, INDEX_WAIT_S)
    measured = workload.measured
    offered = "" if rate is None else f" at {rate:g}/s"
    progress(f"{arm}/{workload.name}{tag}: {len(measured)} measured requests{offered} "
             f"({len(workload.main) - len(measured)} background)")
    before, fleet_before = fleet.counters(), fleet.fleet_counters()
    records = asyncio.run(run_phase(workload.main, fleet.urls,
                                    sender="kvpeer" if workload.pinned else "vllm"))
    after, fleet_after = fleet.counters(), fleet.fleet_counters()
    counters = None if before is None or after is None else after - before
    kept = [rec for rec, req in zip(records, workload.main, strict=True) if req.measured]
    cell = summarize(arm, workload.name, kept, counters, fleet_after - fleet_before, rate)
    if observe is not None:
        observe(arm, workload.name, kept)
    progress(
        f"{arm}/{workload.name}{tag}: TTFT mean {_ms(cell.ttft_mean_s)} p50 "
        f"{_ms(cell.ttft_p50_s)} p99 {_ms(cell.ttft_p99_s)}, {cell.errors} errors, plans "
        + (", ".join(f"{r} {n}" for r, n in sorted(cell.plans.items())) or "-")
    )
    return cell, failed


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"
