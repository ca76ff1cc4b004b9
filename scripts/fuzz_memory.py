"""A fuzzed node's memory, with and without the driver's heap trim (issue 30, item 3).

Runs ``kvpeer fuzz``'s harness twice in one go on the same seed and frame count: a
``kvpeer serve`` node with ``--no-heap-trim --malloc-arenas 0`` (the baseline: glibc's
defaults), then one as it runs by default (one malloc arena, its driver trims the
heap: :mod:`kvpeer.node.trim`), and
prints for each the RSS after the warm-up, after the run (the goodbyes, then one
look of the trimmer) and the difference. ``--trim-only`` runs a third node that trims but keeps
glibc's arenas (``--malloc-arenas 0``): trimming alone does not bound the growth.

    PYTHONPATH=src python scripts/fuzz_memory.py --frames 1000000 [--trim-only]
"""

from __future__ import annotations

import argparse
import sys
import time

from kvpeer.lab.fuzz.fuzz_results import MiB
from kvpeer.lab.fuzz.fuzz_run import FuzzSpec, run_fuzz
from kvpeer.lab.fuzz.report import memory_line

BOUND_MIB = 64
GLIBC_DEFAULTS = ("--no-heap-trim", "--malloc-arenas", "0")


def arm(name: str, frames: int, seed: int, node_args: tuple[str, ...]) -> tuple[float, float]:
    spec = FuzzSpec(frames=frames, seed=seed, warmup=min(frames, 10_000), node_args=node_args)
    started = time.monotonic()
    result = run_fuzz(spec, lambda message: print(f"  [{name}] {message}", file=sys.stderr))
    assert result.usage_warm is not None, result.problems
    assert result.usage_end is not None, result.problems
    warm, end = result.usage_warm.rss_bytes / MiB, result.usage_end.rss_bytes / MiB
    print(f"{name:>22}: {memory_line(result).strip()}  ({time.monotonic() - started:.0f} s)")
    for problem in result.problems:
        print(f"{'':>24}problem: {problem}")
    return warm, end


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trim-only", action="store_true", help="also run a node that trims only")
    args = parser.parse_args()
    rows = {
        "glibc defaults": arm("glibc defaults", args.frames, args.seed, GLIBC_DEFAULTS),
        "kvpeer serve default": arm("kvpeer serve default", args.frames, args.seed, ()),
    }
    if args.trim_only:
        rows["trim only"] = arm("trim only", args.frames, args.seed, ("--malloc-arenas", "0"))
    print(f"\n{'node':>30} {'warm MiB':>9} {'end MiB':>8} {'growth':>8}  within {BOUND_MIB} MiB")
    for name, (warm, end) in rows.items():
        grown = end - warm
        print(f"{name:>30} {warm:9.1f} {end:8.1f} {grown:+8.1f}  {grown <= BOUND_MIB}")
    off, on = rows["glibc defaults"], rows["kvpeer serve default"]
    if off[1] - off[0] > 0:
        ratio = (on[1] - on[0]) / (off[1] - off[0])
        print(f"growth as kvpeer serve runs / with glibc's defaults: {ratio:.2f}")
    return 0 if on[1] - on[0] <= BOUND_MIB else 1


if __name__ == "__main__":
    sys.exit(main())
