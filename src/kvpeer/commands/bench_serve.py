"""``kvpeer bench serve``: TTFT under workloads through ``kvpeer router``, per fleet."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvpeer.commands.progress import progress_printer

HELP = ("TTFT through kvpeer router: kvpeer vs a prefix-aware router with no tier, load only, "
        "vLLM's p2p tier")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpeer.lab.bench import serve_bench

    serve_bench.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import serve_bench, serve_vllm
    from kvpeer.lab.bench.serve_stats import render
    from kvpeer.lab.demo_run import default_model_dir

    spec = serve_bench.ServeBenchSpec.from_args(args)  # bad values fail before any engine starts

    progress = progress_printer("bench serve")

    result = serve_vllm.run(
        spec,
        model_dir=Path(args.model or default_model_dir(os.environ.get("XDG_CACHE_HOME"))),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        progress=progress,
    )
    if args.plot:
        from kvpeer.lab.bench.serve_plot import plot

        plot(result.cells, Path(args.plot))
        progress(f"TTFT CDFs written to {args.plot}")
    if result.loads and not args.json:
        print("offered loads (requests/s): " + "; ".join(
            f"{name} {low:g} and {high:g}" for name, (low, high) in result.loads.items()))
    print(json.dumps(result.to_json()) if args.json else render(
        result.cells, result.errors, result.seconds, result.setup_errors, result.logs,
        result.repeat_cells))
    if result.timelines and not args.json:
        print("\nTimelines (--trace; wall clock, from the router's send)")
        print("\n".join(result.timelines))
    return 0 if result.ok else 1
