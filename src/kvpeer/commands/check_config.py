"""``kvpeer check-config``: validate a vLLM ``kv_transfer_config`` (or one tier entry), or a
router TOML file; every problem at once, one line each."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpeer.checkconfig import DEVICES, check_transfer_config
from kvpeer.errors import ConfigError
from kvpeer.router import config as router_config
from kvpeer.router import configcheck

HELP = ("validate a vLLM kv_transfer_config (or one kvpeer tier entry) JSON file, or a "
        "kvpeer router TOML file (*.toml)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file")
    parser.add_argument(
        "--device", choices=DEVICES,
        help="where the engine's KV cache lives (vllm serve's device): a GPU refuses a "
             "CPU-only offloading spec",
    )


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if path.suffix == ".toml":
        return _router(path)
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2
    problems = check_transfer_config(loaded, device=args.device)
    for problem in problems:
        print(f"{args.file}: {problem}")
    if not problems:
        print(f"{args.file}: ok")
    return 1 if problems else 0


def _router(path: Path) -> int:
    """A ``kvpeer router --config`` file: every problem, as ``kvpeer router`` names it."""
    try:
        mapping = router_config.load_file(path)
    except ConfigError as exc:  # unreadable, not TOML
        print(exc, file=sys.stderr)
        return 2
    problems = configcheck.problems(mapping, str(path))
    for problem in problems:
        print(problem)
    if not problems:
        print(f"{path}: ok")
    return 1 if problems else 0
