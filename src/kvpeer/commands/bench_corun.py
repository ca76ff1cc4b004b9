"""``kvpeer bench corun``: what slows a prefill beside other work: memory bandwidth or compute."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvpeer.commands.progress import progress_printer

HELP = "what slows a prefill beside other work here: memory bandwidth or compute"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=4, help="turns of every arm (default 4)")
    parser.add_argument("--prompt-tokens", type=int, default=2016,
                        help="tokens of each fresh prompt the engine prefills (default 2016)")
    parser.add_argument(
        "--model", help="checkpoint directory (default ~/.cache/kvpeer/serve-llama)"
    )
    parser.add_argument("--log-dir", help="keep the engine's log here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvpeer.errors import ConfigError
    from kvpeer.lab.bench import corun
    from kvpeer.lab.demo_run import default_model_dir

    try:
        spec = corun.CorunSpec(turns=args.turns, prompt_tokens=args.prompt_tokens)
    except ValueError as exc:
        raise ConfigError(f"bench corun: {exc}") from None
    result = corun.run(
        spec,
        Path(args.model or default_model_dir(os.environ.get("XDG_CACHE_HOME"))),
        progress_printer("bench corun"),
        Path(args.log_dir) if args.log_dir else None,
    )
    print(json.dumps(result) if args.json else corun.render(result))
    return 0
