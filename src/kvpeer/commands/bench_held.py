"""``kvpeer bench held``: a pull from an idle producer, held blocks vs the serve window."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvpeer.commands.progress import progress_printer

HELP = "a pull from an idle producer: held blocks vs the serve window"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=5, help="fresh prompts per path")
    parser.add_argument("--idle-seconds", type=float, default=1.0, help="idle before each pull")
    parser.add_argument("--held-mib", type=int, default=128, help="held_bytes of engine a, MiB")
    parser.add_argument(
        "--model", help="checkpoint directory (default ~/.cache/kvpeer/serve-llama)"
    )
    parser.add_argument("--log-dir", help="keep the engines' logs here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import held_bench
    from kvpeer.lab.demo_run import default_model_dir

    progress = progress_printer("bench held")

    spec = held_bench.HeldSpec(
        prompts=args.prompts, idle_s=args.idle_seconds, held_bytes=args.held_mib << 20
    )
    result = held_bench.run(
        spec,
        Path(args.model or default_model_dir(os.environ.get("XDG_CACHE_HOME"))),
        progress,
        Path(args.log_dir) if args.log_dir else None,
    )
    print(json.dumps(result) if args.json else held_bench.render(result))
    return 0
