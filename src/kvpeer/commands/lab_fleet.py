"""``kvpeer lab fleet``: the fleet model -- a trace through the router's own code to
simulated GPU engines, at fleet sizes, loads and links no machine here has."""

from __future__ import annotations

import argparse
import json

from kvpeer.commands.progress import progress_printer

HELP = "fleet model: a Mooncake trace through the router's real policy to simulated GPU engines"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpeer.lab.fleet import cli

    cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.fleet import cli

    result = cli.run(args, progress_printer("lab fleet"))
    print(json.dumps(result, indent=1) if args.json else cli.render(result))
    return 0
