"""``kvpeer bench ladder``: one fresh prompt computed, as a local hit, pulled from an
idle producer and pulled from a producer busy with another client's long prefill."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvpeer.commands.progress import progress_printer
from kvpeer.config import TierConfig

HELP = "a fresh prompt: computed, local hit, pulled from an idle and from a busy producer"


def _rounds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of rounds >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompts", type=_rounds, default=5, help="rounds, each with two fresh prompts"
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=1.0,
        help="idle before each measured local hit and pull",
    )
    parser.add_argument("--held-mib", type=int,
                        help="held_bytes of each engine, MiB (default: the tier's own, a "
                             "quarter of the CPU tier)")
    parser.add_argument(
        "--sync-pull-wait",
        type=float,
        help="the tiers' sync_pull_wait_s (default: the tier's own, 0.05)",
    )
    parser.add_argument(
        "--no-ahead", dest="ahead", action="store_false",
        help="skip the rungs the router starts ahead (prefetch: kvpeer.node.ahead)",
    )
    parser.add_argument(
        "--unpinned", action="store_true",
        help="instead: with the producer busy and the prompts out of its held copy, one "
             "request the router places alone, beside a pinned pull and a local compute",
    )
    parser.add_argument(
        "--model", help="checkpoint directory (default ~/.cache/kvpeer/serve-llama)"
    )
    parser.add_argument("--log-dir", help="keep the engines' logs here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import ladder
    from kvpeer.lab.demo_run import default_model_dir

    progress = progress_printer("bench ladder")
    if args.sync_pull_wait is not None:  # a bad value is named now, not by two engines later
        TierConfig.from_dict({"sync_pull_wait_s": args.sync_pull_wait})
    model = Path(args.model or default_model_dir(os.environ.get("XDG_CACHE_HOME")))
    logs = Path(args.log_dir) if args.log_dir else None
    if args.unpinned:
        from kvpeer.lab.bench import ladder_unpinned

        held = None if args.held_mib is None else args.held_mib << 20
        unpinned = ladder_unpinned.UnpinnedSpec(
            prompts=args.prompts, idle_s=args.idle_seconds, held_bytes=held,
            sync_pull_wait_s=args.sync_pull_wait,
        )
        found = ladder_unpinned.run(unpinned, model, progress, logs)
        print(json.dumps(found) if args.json else ladder_unpinned.render(found))
        return 0
    spec = ladder.LadderSpec(
        prompts=args.prompts,
        idle_s=args.idle_seconds,
        held_bytes=None if args.held_mib is None else args.held_mib << 20,
        sync_pull_wait_s=args.sync_pull_wait,
        ahead=args.ahead,
    )
    result = ladder.run(spec, model, progress, logs)
    print(json.dumps(result) if args.json else ladder.render(result))
    return 0
