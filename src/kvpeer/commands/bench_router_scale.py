"""``kvpeer bench router-scale``: the router's data layer as the fleet grows."""

from __future__ import annotations

import argparse
import json

from kvpeer.commands.progress import progress_printer

HELP = "router data layer vs fleet size: event intake CPU, index memory, decision time"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpeer.lab.bench import router_scale

    router_scale.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import router_scale

    progress = progress_printer("bench router-scale")

    spec = router_scale.RouterScaleSpec.from_args(args)
    result = router_scale.run(spec, progress)
    print(json.dumps(result) if args.json else router_scale.render(result))
    return 0
