"""``kvpeer bench idle``: idle engines' CPU and lookup answer time, kvpeer vs vLLM p2p."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvpeer.commands.progress import progress_printer
from kvpeer.errors import KVPeerError

HELP = "idle engines' CPU and lookup answer time: kvpeer vs vLLM's p2p tier"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer engines and lookups")
    parser.add_argument(
        "--seconds", type=float, help="idle seconds measured (default 10; quick 4)"
    )
    parser.add_argument(
        "--model", help="checkpoint directory (default ~/.cache/kvpeer/tiny-llama)"
    )
    parser.add_argument("--log-dir", help="keep the engines' logs here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import idle
    from kvpeer.lab.demo_run import default_model_dir
    from kvpeer.transport.data.nixl import NixlBackend

    if not NixlBackend.available():  # vLLM's p2p tier, the comparison, needs it
        raise KVPeerError("kvpeer bench idle needs nixl (vLLM's p2p tier runs on it)")
    make = idle.IdleSpec.quick if args.quick else idle.IdleSpec.full
    spec = make() if args.seconds is None else make(idle_s=args.seconds)

    progress = progress_printer("bench idle")

    result = idle.run(
        spec,
        model_dir=Path(
            args.model or default_model_dir(os.environ.get("XDG_CACHE_HOME"), "tiny-llama")
        ),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        progress=progress,
    )
    print(json.dumps(result) if args.json else idle.render(result))
    return 0
