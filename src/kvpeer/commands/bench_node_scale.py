"""``kvpeer bench node-scale``: one node with 127 peer sessions."""

from __future__ import annotations

import argparse
import json

from kvpeer.commands.progress import progress_printer

HELP = "one node with 127 peer sessions: idle CPU and memory per session, lookups at once"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpeer.lab.bench import node_scale

    node_scale.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import node_scale

    progress = progress_printer("bench node-scale")

    result = node_scale.run(node_scale.NodeScaleSpec.from_args(args), progress)
    print(json.dumps(result) if args.json else node_scale.render(result))
    return 0
