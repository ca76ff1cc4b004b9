"""``kvpeer bench node-scale``: one node with 127 peer sessions."""

from __future__ import annotations

import argparse
import json
import sys

from kvpeer.lab.bench import node_scale

HELP = "one node with 127 peer sessions: idle CPU and memory per session, lookups at once"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    node_scale.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    def progress(message: str) -> None:
        print(f"kvpeer bench node-scale: {message}", file=sys.stderr, flush=True)

    result = node_scale.run(node_scale.NodeScaleSpec.from_args(args), progress)
    print(json.dumps(result) if args.json else node_scale.render(result))
    return 0
