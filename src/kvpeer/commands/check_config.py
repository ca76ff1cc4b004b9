"""``kvpeer check-config``: validate a vLLM ``kv_transfer_config`` (or one tier entry)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpeer.checkconfig import DEVICES, check_transfer_config

HELP = "validate a vLLM kv_transfer_config (or one kvpeer tier entry) JSON file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file")
    parser.add_argument(
        "--device", choices=DEVICES,
        help="where the engine's KV cache lives (vllm serve's device): a GPU refuses a "
             "CPU-only offloading spec",
    )


def run(args: argparse.Namespace) -> int:
    try:
        loaded = json.loads(Path(args.file).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2
    problems = check_transfer_config(loaded, device=args.device)
    for problem in problems:
        print(f"{args.file}: {problem}")
    if not problems:
        print(f"{args.file}: ok")
    return 1 if problems else 0
