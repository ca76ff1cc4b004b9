"""``kvpeer demo``: two ``vllm serve`` engines behind ``kvpeer router`` share KV."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvpeer.commands.progress import progress_printer

HELP = "two vllm serve engines behind kvpeer router share KV over HTTP (pd, shared, chat)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-plane", default="shm", help="shm (default), tcp or nixl: the plane both use"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=1536, help="prompt length (64..1536, default 1536)"
    )
    parser.add_argument(
        "--model", help="checkpoint directory (default ~/.cache/kvpeer/serve-llama)"
    )
    parser.add_argument(
        "--log-dir", help="keep the engines' logs here (default: kept on failure)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab import demo_run

    progress = progress_printer("demo")

    result = demo_run.run_demo(
        data_plane=args.data_plane,
        prompt_tokens=args.prompt_tokens,
        model_dir=Path(args.model or demo_run.default_model_dir(os.environ.get("XDG_CACHE_HOME"))),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        progress=progress,
    )
    print(json.dumps(result.to_json()) if args.json else demo_run.render(result))
    return 0 if result.ok else 1
