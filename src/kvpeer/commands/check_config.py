"""``kvpeer check-config``: validate a vLLM ``kv_transfer_config`` (or one tier entry), or a
router TOML file; every problem at once, one line each."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpeer import configschema
from kvpeer.checkconfig import DEVICES, check_transfer_config, effective_settings
from kvpeer.errors import ConfigError
from kvpeer.router import config as router_config
from kvpeer.router import configcheck

HELP = ("validate a vLLM kv_transfer_config (or one kvpeer tier entry) JSON file, or a "
        "kvpeer router TOML file (*.toml)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", help="the file to check (*.toml: a router's)")
    parser.add_argument(
        "--schema", choices=("tier", "router"),
        help="print the JSON Schema of a tier entry or a router TOML file instead",
    )
    parser.add_argument(
        "--device", choices=DEVICES,
        help="where the engine's KV cache lives (vllm serve's device): a GPU refuses a "
             "CPU-only offloading spec",
    )
    parser.add_argument(
        "--json", action="store_true",
        help="print one JSON object: file, kind (tier or router), ok, problems",
    )


def run(args: argparse.Namespace) -> int:
    if args.schema is not None:
        print(json.dumps(configschema.schemas()[args.schema], indent=2))
        return 0
    if args.file is None:
        raise ConfigError("check-config: give a file to check (or --schema tier|router)")
    path = Path(args.file)
    if path.suffix == ".toml":
        return _router(path, as_json=args.json)
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        print(f"kvpeer: {args.file}: {exc}", file=sys.stderr)
        return 2
    problems = [f"{args.file}: {p}" for p in check_transfer_config(loaded, device=args.device)]
    return _report(str(path), "tier", problems, as_json=args.json,
                   effective=effective_settings(loaded))


def _router(path: Path, *, as_json: bool) -> int:
    """A ``kvpeer router --config`` file: every problem, as ``kvpeer router`` names it."""
    try:
        mapping = router_config.load_file(path)
    except ConfigError as exc:  # unreadable, not TOML
        print(f"kvpeer: {exc}", file=sys.stderr)
        return 2
    return _report(str(path), "router", configcheck.problems(mapping, str(path)),
                   as_json=as_json)


def _report(file: str, kind: str, problems: list[str], *, as_json: bool,
            effective: list[str] | None = None) -> int:
    """Every problem, one a line (or one JSON object); exit 1 on problems. A valid tier
    config also says what its defaults come to (``effective``)."""
    if as_json:
        document = {"file": file, "kind": kind, "ok": not problems, "problems": problems}
        if effective is not None:
            document["effective"] = effective
        print(json.dumps(document, indent=2))
    else:
        for problem in problems:
            print(problem)
        if not problems:
            print(f"{file}: ok")
            for line in effective or ():
                print(f"  {line}")
    return 1 if problems else 0
