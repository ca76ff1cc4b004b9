"""``kvpeer fuzz``: drive a real node with generated hostile frames and watch it."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from kvpeer.commands.options import csv
from kvpeer.commands.progress import progress_printer
from kvpeer.errors import KVPeerError

HELP = "drive a real node with generated hostile frames and watch it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--frames", type=int, default=1_000_000, help="frames to send (default 1,000,000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument(
        "--data-planes",
        type=csv,
        help="the node's planes (default: shm,tcp; a nixl node trusts no fuzz peer)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=25_000,
        help="frames between checks of the node and legitimate pulls (default 25,000)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        help="a case label prefix or scenario not to send, e.g. a known crash (repeatable)",
    )
    parser.add_argument(
        "--stop-on-crash", action="store_true", help="stop at the first crash (default: restart)"
    )
    parser.add_argument(
        "--minimize", action="store_true", help="shrink each crash to a short reproducer"
    )
    parser.add_argument("--workdir", help="keep the node's logs here (default: kept on failure)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    # The legitimate consumers' UCX writes its errors to stdout (an interface that
    # another test on the machine removed, say): that would corrupt the report.
    os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
    from kvpeer.lab.fuzz import fuzz_run, report

    planes = tuple(args.data_planes or fuzz_run.available_planes())
    try:
        spec = fuzz_run.FuzzSpec(
            frames=args.frames,
            seed=args.seed,
            planes=planes,
            checkpoint_every=args.checkpoint_every,
            warmup=min(args.frames, 10_000),
            keep_going=not args.stop_on_crash,
            exclude=tuple(args.exclude or ()),
            workdir=Path(args.workdir) if args.workdir else None,
        )
    except ValueError as exc:
        raise KVPeerError(str(exc)) from exc
    if args.log_level.upper() == "WARNING":  # the legitimate consumers' goodbyes are noise
        logging.getLogger("kvpeer").setLevel(logging.ERROR)

    progress = progress_printer("fuzz")

    progress(
        f"{spec.frames:,} frames, seed {spec.seed}, data planes {','.join(planes)}; "
        "starting the node"
    )
    result = fuzz_run.run_fuzz(spec, progress, minimize=args.minimize)
    print(json.dumps(report.to_json(result)) if args.json else report.render(result))
    return 0 if result.ok else 1
