"""``kvpeer router``: the OpenAI-compatible HTTP router in front of vLLM engines."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpeer.commands.options import ready_file_option
from kvpeer.router import config, configcheck

HELP = "OpenAI-compatible HTTP router in front of vLLM engines (pd or shared)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpeer.router import server

    ready_file_option(args.ready_file)
    ready = Path(args.ready_file) if args.ready_file else None
    return server.run(configcheck.from_args(args), ready_file=ready)
