"""The router's event intake alone, on one recorded fleet: the same events through any
checkout's intake, to compare commits (docs/scale.md).

``record`` runs ``kvpeer bench router-scale``'s synthetic engines for one fleet size and
saves every batch they publish (warm-up, then one timed second). ``replay`` feeds the
warm-up through ``EventFeed`` -> ``decode_batch`` -> ``PrefixIndex`` untimed, then the
timed second on the process CPU clock, and prints the cores that second needs::

    python src/kvpeer/lab/bench/intake_replay.py record 256 /tmp/fleet256.pkl
    python src/kvpeer/lab/bench/intake_replay.py replay /tmp/fleet256.pkl --loops c
    PYTHONPATH=/path/to/old/checkout/src \\
        python src/kvpeer/lab/bench/intake_replay.py replay /tmp/fleet256.pkl

Run as a file, it imports the router from whatever ``kvpeer`` is on the path, so an
older checkout's intake replays the same batches (``--loops`` is then ignored when that
checkout's index has no such choice). The recording is a pickle of our own making:
never replay a file from elsewhere.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from kvpeer.router.feed import EventFeed
from kvpeer.router.index import PrefixIndex

Batches = list[tuple[str, list[bytes]]]


def record(engines_n: int, out: Path, seconds: float = 1.0) -> dict[str, Any]:
    from kvpeer.lab.bench import router_scale as rs

    spec = rs.RouterScaleSpec(fleets=(engines_n,), seconds=seconds)
    rng = random.Random(spec.seed * 1_000_003 + engines_n)
    workload = rs._Workload(spec, rng)
    engines = [rs.SyntheticEngine(f"e{i}", spec, rng) for i in range(engines_n)]
    per_request = (spec.prompt_tokens - spec.prefix_tokens) // spec.block_size
    fill = int(spec.cpu_blocks / per_request / (spec.requests_per_s * rs.STEP_S)) + 1
    warm = fill + int(spec.warmup_s / rs.STEP_S)
    total = warm + int(seconds / rs.STEP_S)
    steps: list[tuple[float, Batches]] = []
    now = 0.0
    for i in range(total):
        now += rs.STEP_S
        steps.append((now, rs._steps(engines, workload, rng, spec.requests_per_s, now)))
        if i % 20 == 0:
            print(f"intake-replay: recorded step {i} of {total}", file=sys.stderr, flush=True)
    recording = {"warm": warm, "seconds": seconds, "steps": steps,
                 "names": [e.name for e in engines], "block_size": spec.block_size}
    out.write_bytes(pickle.dumps(recording, protocol=pickle.HIGHEST_PROTOCOL))
    return {"engines": engines_n, "steps": total, "warm_steps": warm, "file": str(out)}


def _index(block_size: int, loops: str) -> PrefixIndex:
    if loops == "default":
        return PrefixIndex(block_size)
    try:
        return PrefixIndex(block_size, native=loops == "c")  # type: ignore[call-arg,unused-ignore]
    except TypeError:  # an older checkout: one kind of loop
        return PrefixIndex(block_size)


def _python_only() -> AbstractContextManager[None]:
    """Translation and hashing in Python too, where the checkout has them in C."""
    try:
        from kvpeer.lab.bench.router_scale import without_c
    except ImportError:  # an older checkout: only its index's loops were in C
        return nullcontext()
    return without_c()


def replay(path: Path, loops: str = "default") -> dict[str, Any]:
    recording = pickle.loads(path.read_bytes())  # our own file (module docstring)
    index = _index(recording["block_size"], loops)
    feeds = {name: EventFeed(can_replay=False, sink=partial(index.apply, name))
             for name in recording["names"]}
    warm, steps = recording["warm"], recording["steps"]
    for now, batches in steps[:warm]:
        for name, parts in batches:
            feeds[name].on_live(parts, now)
    window = steps[warm:]
    events = sum(len(msgspec.msgpack.decode(parts[2])[1])
                 for _, batches in window for _, parts in batches)
    cpu = time.process_time()
    with _python_only() if loops == "python" else nullcontext():
        for now, batches in window:
            for name, parts in batches:
                feeds[name].on_live(parts, now)
    cpu = time.process_time() - cpu
    native = getattr(index, "native", False)
    return {"engines": len(recording["names"]), "events": events, "intake_cpu_s": cpu,
            "cores_needed": cpu / recording["seconds"],
            "us_per_event": cpu / events * 1e6 if events else 0.0,
            "loops": "C" if native else "Python"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="intake_replay", description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    rec = verbs.add_parser("record", help="record one synthetic fleet's batches")
    rec.add_argument("engines", type=int)
    rec.add_argument("out", type=Path)
    rec.add_argument("--seconds", type=float, default=1.0, help="timed seconds (default 1)")
    rep = verbs.add_parser("replay", help="time the intake over a recording")
    rep.add_argument("recording", type=Path)
    rep.add_argument("--loops", choices=("default", "c", "python"), default="default")
    rep.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.verb == "record":
        if args.engines < 1 or args.seconds <= 0:
            parser.error(f"engines must be positive and seconds above 0, got "
                         f"{args.engines} and {args.seconds}")
        print(json.dumps(record(args.engines, args.out, args.seconds)))
        return 0
    if not args.recording.is_file():
        parser.error(f"no recording at {args.recording}")
    result = replay(args.recording, args.loops)
    print(json.dumps(result) if args.json else
          f"{result['engines']} engines, {result['events']:,} events: intake "
          f"{result['intake_cpu_s']:.3f} CPU-s, {result['us_per_event']:.2f} us per event, "
          f"{result['cores_needed']:.2f} cores ({result['loops']} loops)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
