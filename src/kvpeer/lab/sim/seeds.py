"""``python -m kvpeer.sim --seeds N [--first-seed S] [--nodes K]``: run seeded worlds.

Exit status 1 if any seed found a violation. The last stdout line is always ``seeds=N
violations=V jobs=J loads_ok=L loads_failed=F``; the one before it counts the faults
injected, the one before that what the worlds' held blocks did
(:mod:`kvpeer.lab.sim.held`), and the one before that what pulling ahead did
(:mod:`kvpeer.lab.sim.ahead`; a run of at least as many worlds that pulled ahead in
which no load used a staged block fails the same way). Each failing seed prints a
one-line command that reproduces it. A run of at least :data:`HELD_SELF_CHECK_WORLDS`
worlds with held blocks (of the default length or longer) in which no peer was ever
written a block from them fails too, counted as one violation: the model of engine-less
serving went dead, and its checks with it. The tier iterates some sets of strings, so a
run is reproducible only under a fixed ``PYTHONHASHSEED``: when none is set, the CLI
re-executes itself with ``PYTHONHASHSEED=0``. With ``--jobs N`` seeds run in N worker
processes (forked, so they share the hash seed); each world is still one process, one
thread, and the output is the same.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial

from kvpeer.lab.sim.ahead import AheadCounts
from kvpeer.lab.sim.world import HeldCounts, SeedResult, run_seed

DEFAULT_TICKS = 200
# Of 100 such worlds, 94 served a peer from held blocks: 20 that all served none
# is no accident.
HELD_SELF_CHECK_WORLDS = 20


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvpeer.sim",
        description="Deterministic multi-node simulation of kvpeer tiers.",
    )
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds to run")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed")
    parser.add_argument("--nodes", type=int, default=3, help="nodes per world (at least 2)")
    parser.add_argument(
        "--ticks",
        type=int,
        default=DEFAULT_TICKS,
        help="engine steps per world before the quiet phase",
    )
    parser.add_argument(
        "--soak", action="store_true", help="10x the ticks and more faults per world"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print every seed's summary and every violation"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="worker processes (seeds are independent)"
    )
    return parser


def _reproduce(seed: int, args: argparse.Namespace) -> str:
    command = f"python -m kvpeer.sim --seeds 1 --first-seed {seed} --nodes {args.nodes}"
    if args.ticks != DEFAULT_TICKS:
        command += f" --ticks {args.ticks}"
    if args.soak:
        command += " --soak"
    hash_seed = os.environ.get("PYTHONHASHSEED", "0")
    return command if hash_seed == "0" else f"PYTHONHASHSEED={hash_seed} {command}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.nodes < 2:
        _parser().error(f"--nodes must be at least 2, got {args.nodes}")
    if args.seeds < 0 or args.ticks < 1 or args.jobs < 1:
        _parser().error("--seeds must be >= 0, --ticks and --jobs >= 1")
    violations = jobs = loads_ok = loads_failed = 0
    faults = {"deaths": 0, "partitions": 0, "freezes": 0, "restarts": 0}
    held, held_worlds = HeldCounts(), 0
    ahead, ahead_worlds = AheadCounts(), 0
    started = time.monotonic()
    cpu_started = _cpu_seconds()
    every = max(1, args.seeds // 10)
    for done, result in enumerate(_results(args), 1):
        seed = result.seed
        violations += len(result.violations)
        jobs += result.jobs
        loads_ok += result.loads_ok
        loads_failed += result.loads_failed
        for name in faults:
            faults[name] += getattr(result, name)
        if result.held is not None:
            held += result.held
            held_worlds += 1
        if result.ahead is not None:
            ahead += result.ahead
            ahead_worlds += 1
        if args.verbose:
            print(result.summary())
            for violation in result.violations:
                print(f"  {violation}")
        if result.violations:
            print(
                f"FAILED seed {seed}: {len(result.violations)} violation(s), first: "
                f"{result.violations[0]}"
            )
            print(f"  reproduce: {_reproduce(seed, args)}")
        if args.seeds >= 20 and done % every == 0:
            print(
                f"kvpeer.sim: {done}/{args.seeds} seeds, {violations} violations, "
                f"{time.monotonic() - started:.1f}s",
                file=sys.stderr,
            )
        sys.stdout.flush()
    for dead in (_held_dead(args, held_worlds, held), _ahead_dead(args, ahead_worlds, ahead)):
        if dead:
            violations += 1
            print(f"FAILED self-check: {dead}")
    print(f"ahead: worlds={ahead_worlds} {ahead.summary()}")
    print(f"held: worlds={held_worlds} {held.summary()}")
    print("faults: " + " ".join(f"{name}={count}" for name, count in faults.items()))
    print(_timing(args, time.monotonic() - started, _cpu_seconds() - cpu_started), file=sys.stderr)
    print(
        f"seeds={args.seeds} violations={violations} jobs={jobs} "
        f"loads_ok={loads_ok} loads_failed={loads_failed}"
    )
    return 1 if violations else 0


def _held_dead(args: argparse.Namespace, worlds: int, held: HeldCounts) -> str | None:
    """Why the run's held blocks prove nothing, if they don't (module docstring)."""
    if worlds < HELD_SELF_CHECK_WORLDS or args.ticks < DEFAULT_TICKS:
        return None
    if held.served and held.written:
        return None
    return (
        f"{worlds} worlds kept held blocks ({held.kept} copied) but served {held.served} "
        f"pins and wrote {held.written} blocks to peers from them: engine-less serving "
        "is not exercised"
    )


def _ahead_dead(args: argparse.Namespace, worlds: int, ahead: AheadCounts) -> str | None:
    """Why the run's pulling ahead proves nothing, if it doesn't: no staged block was
    ever used by a load (then the copy out of staging, and its checks, never ran)."""
    if worlds < HELD_SELF_CHECK_WORLDS or args.ticks < DEFAULT_TICKS or ahead.used:
        return None
    return (
        f"{worlds} worlds pulled ahead ({ahead.sent} prefetches, {ahead.staged} blocks "
        "staged) but no load ever used a staged block: pulling ahead is not exercised"
    )


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished workers (--jobs)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _timing(args: argparse.Namespace, wall_s: float, cpu_s: float) -> str:
    """The stderr line with the time per seed (CPU is what a loaded machine cannot
    inflate; wall is what a run waits)."""
    per = max(1, args.seeds)
    return (
        f"kvpeer.sim: {args.seeds} seeds of {args.nodes} nodes in {wall_s:.2f} s wall, "
        f"{cpu_s:.2f} s CPU: {wall_s / per * 1e3:.0f} ms wall, {cpu_s / per * 1e3:.0f} ms CPU "
        f"per seed"
    )


def _results(args: argparse.Namespace) -> Iterator[SeedResult]:
    """Every seed's result, in seed order."""
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if args.jobs <= 1:
        for seed in seeds:
            yield run_seed(seed, args.nodes, args.ticks, soak=args.soak)
        return
    one = partial(run_seed, nodes=args.nodes, ticks=args.ticks, soak=args.soak)
    with ProcessPoolExecutor(args.jobs) as pool:
        yield from pool.map(one, seeds, chunksize=8)


def _pin_hash_seed() -> None:
    """Re-execute under PYTHONHASHSEED=0 unless a fixed hash seed is already set."""
    if os.environ.get("PYTHONHASHSEED", "random") == "random":
        env = dict(os.environ, PYTHONHASHSEED="0")
        argv = [sys.executable, "-m", "kvpeer.sim", *sys.argv[1:]]
        os.execve(sys.executable, argv, env)


def command() -> None:
    """``python -m kvpeer.sim``: run under a fixed hash seed, exit with :func:`main`'s status."""
    _pin_hash_seed()
    sys.exit(main())


if __name__ == "__main__":
    command()
