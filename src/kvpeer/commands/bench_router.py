"""``kvpeer bench router``: the router's added latency and throughput vs a direct baseline."""

from __future__ import annotations

import argparse
import json

from kvpeer.commands.progress import progress_printer

HELP = "router overhead: added latency and requests/s vs a direct baseline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpeer.lab.bench import router_bench

    router_bench.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import router_bench

    progress = progress_printer("bench router")

    spec = router_bench.RouterBenchSpec.from_args(args)
    result = router_bench.run(spec, progress)
    print(json.dumps(result) if args.json else router_bench.render(result))
    return 0
