"""``kvpeer bench trace``: a window of a Mooncake trace through kvpeer router and two real
``vllm serve`` engines, per arm."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvpeer.commands.progress import progress_printer

HELP = "replay a trace window (Mooncake format) through kvpeer router and real vllm serve engines"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpeer.lab.bench.trace_bench import DEFAULT_ARMS, QUICK_WINDOW_S

    parser.add_argument("--trace", required=True, help="a trace file in Mooncake's format")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help="affinity, load, kvpeer, vllm-p2p (comma-separated)")
    parser.add_argument("--block-tokens", type=int, default=32,
                        help="tokens per trace id: the engines' block (32)")
    parser.add_argument("--time-scale", type=float, default=4.0,
                        help="multiply the trace's timestamps (4: a quarter of its rate)")
    parser.add_argument("--window-start", type=float, default=0.0, help="trace seconds")
    parser.add_argument("--window", type=float, default=None,
                        help=f"trace seconds to replay (30; --quick: {QUICK_WINDOW_S:g})")
    parser.add_argument("--slo", type=float, default=2.0, help="TTFT SLO for goodput, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sender", choices=("vllm", "kvpeer"), default="vllm",
                        help="vLLM's request function (default) or kvpeer's client")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the arms in N turns (A B, A B); report each arm's median")
    parser.add_argument("--probe", action="store_true",
                        help="measure the engines first (prefill, hit, decode, pull): the "
                             "fleet model's CPU preset")
    parser.add_argument("--quick", action="store_true", help="a few seconds of trace")
    parser.add_argument("--model", default=None, help="the random Llama's directory")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import trace_run
    from kvpeer.lab.bench.trace_bench import QUICK_WINDOW_S, TraceBenchSpec, render
    from kvpeer.lab.demo_run import default_model_dir

    window = args.window if args.window is not None else (
        QUICK_WINDOW_S if args.quick else 30.0)
    spec = TraceBenchSpec(
        Path(args.trace), tuple(a.strip() for a in args.arms.split(",") if a.strip()),
        args.block_tokens, args.time_scale, args.window_start, window, args.slo, args.seed,
        args.sender, repeat=args.repeat, probe=args.probe,
    )
    result = trace_run.run(
        spec, model_dir=Path(args.model or default_model_dir(os.environ.get("XDG_CACHE_HOME"))),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        progress=progress_printer("bench trace"),
    )
    print(json.dumps(result) if args.json else render(result))
    return 0 if result["ok"] else 1
