"""``kvpeer lab fleet``'s arguments, its grid of runs and its table."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpeer.errors import ConfigError
from kvpeer.lab.fleet.grid import run_at_load, specs, summary, trace_facts
from kvpeer.lab.fleet.params import LINKS, GpuModel
from kvpeer.lab.fleet.world import BOUNDS, POLICIES, FleetSpec
from kvpeer.lab.trace.mooncake import read_trace
from kvpeer.lab.trace.scaling import TraceScale, scale_trace

__all__ = ["add_arguments", "render", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default="", help="a trace file in Mooncake's format")
    parser.add_argument("--engines", default="8", help="fleet sizes, comma-separated")
    parser.add_argument("--load", default="0.7",
                        help="offered loads as fractions of no-reuse capacity, comma-separated")
    parser.add_argument("--link", default="rdma", help=f"links: {', '.join(LINKS)}")
    parser.add_argument("--policy", default=",".join(POLICIES + BOUNDS),
                        help=f"policies and bounds: {', '.join(POLICIES + BOUNDS)}")
    parser.add_argument("--window", type=float, default=None,
                        help="seconds of the trace from --window-start (default: all of it)")
    parser.add_argument("--window-start", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", type=float, default=2.0, help="TTFT SLO for goodput, seconds")
    parser.add_argument("--event-delay", type=float, default=0.01,
                        help="seconds from an engine's step to the router's index")
    parser.add_argument("--held-sync", action=argparse.BooleanOptionalAction, default=True,
                        help="tiers serve held blocks and engines run kvpeer's connector: "
                             "a pull waits for no engine step (the router's defaults for a "
                             "kvpeer tier; --no-held-sync: a busy source answers at its next "
                             "step and the consumer waits out two)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="TTFT p90 and reuse against load, per fleet size")
    parser.add_argument("--runs-log", default=None, metavar="FILE",
                        help="append each run's row to FILE as one JSON line when it ends")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="render (and --plot) a saved --json result instead of running")


def _list(text: str, kind: Callable[[str], Any], name: str) -> list[Any]:
    try:
        return [kind(part) for part in text.split(",") if part]
    except ValueError as exc:
        raise ConfigError(f"--{name}: {text!r}: {exc}") from exc


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as saved:
            result: dict[str, Any] = json.load(saved)
    else:
        result = _run(args, progress)
    if args.plot:
        from kvpeer.lab.fleet.plot import plot

        plot(result, Path(args.plot))
        progress(f"plot written to {args.plot}")
    return result


def _run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    if not args.trace:
        raise ConfigError("--trace: name a trace file in Mooncake's format")
    engines = _list(args.engines, int, "engines")
    loads = _list(args.load, float, "load")
    links = _list(args.link, str, "link")
    policies = _list(args.policy, str, "policy")
    for link in links:
        if link not in LINKS:
            raise ConfigError(f"--link: {link!r} is not one of {', '.join(LINKS)}")
    for policy in policies:
        if policy not in POLICIES + BOUNDS:
            raise ConfigError(f"--policy: {policy!r} is not one of "
                              f"{', '.join(POLICIES + BOUNDS)}")
    if not engines or min(engines) < 1 or not loads or min(loads) <= 0:
        raise ConfigError("--engines and --load must be positive")
    requests = scale_trace(read_trace(args.trace),
                           TraceScale(window_start_s=args.window_start, window_s=args.window))
    if len(requests) < 2:
        raise ConfigError(f"--trace {args.trace}: fewer than 2 requests in the window")
    gpu = GpuModel()
    base = FleetSpec(seed=args.seed, slo_s=args.slo, event_delay_s=args.event_delay, gpu=gpu,
                     held_sync=args.held_sync)
    runs: list[dict[str, Any]] = []
    ordered = [p for p in ("pooled", "infinite") if p in policies] + [
        p for p in policies if p not in BOUNDS]
    for load in loads:
        pooled: dict[tuple[int, str], float] = {}
        for spec in specs(engines, links, ordered, base):
            progress(f"{spec.engines} engines, {spec.policy}, {spec.link}, load {load:g}")
            result = run_at_load(spec, requests, load)
            if spec.policy == "pooled":
                pooled[(spec.engines, spec.link)] = result.reuse
            row = summary(result, load, pooled.get((spec.engines, spec.link),
                                                   pooled.get((spec.engines, links[0]))))
            runs.append(row)
            if args.runs_log:
                with open(args.runs_log, "a", encoding="utf-8") as log:
                    log.write(json.dumps(row) + "\n")
    return {"trace": str(args.trace), "window_s": args.window,
            "window_start_s": args.window_start, "gpu": gpu.name,
            "facts": trace_facts(requests, gpu), "runs": runs}


def render(result: dict[str, Any]) -> str:
    facts = result["facts"]
    lines = [
        f"{result['trace']}: {facts['requests']} requests, infinite-cache reuse "
        f"{100 * facts['infinite_reuse']:.1f} % of blocks "
        f"({100 * facts['infinite_reuse_full_blocks']:.1f} % of full blocks); "
        f"{result['gpu']}: {facts['capacity_rps_per_engine']:.2f} req/s per engine "
        "at no reuse",
        "",
        f"{'eng':>4} {'load':>5} {'policy':<9} {'link':<7} {'p50 s':>7} {'p90 s':>7} "
        f"{'p99 s':>7} {'good':>6} {'reuse':>6} {'/pool':>6} {'pulls':>6} {'GB moved':>9} "
        f"{'us/dec':>7}",
    ]
    for r in result["runs"]:
        vs = r.get("reuse_vs_pooled", math.nan)
        link = r["link"] if r["policy"] not in ("load", "affinity") else "-"
        policy = r["policy"] + ("+hs" if r.get("held_sync") and r["policy"] == "kvpeer" else "")
        lines.append(
            f"{r['engines']:>4} {r['load']:>5.2f} {policy:<9} {link:<7} "
            f"{r['ttft_p50_s']:>7.3f} {r['ttft_p90_s']:>7.3f} {r['ttft_p99_s']:>7.3f} "
            f"{100 * r['goodput']:>5.1f}% {100 * r['reuse']:>5.1f}% {100 * vs:>5.0f}% "
            f"{r['pulls']:>6} {r['bytes_moved'] / 1e9:>9.1f} "
            f"{r['router_cpu_us_per_decision']:>7.0f}"
        )
    return "\n".join(lines)
