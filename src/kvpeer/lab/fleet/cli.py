"""``kvpeer lab fleet``'s arguments, its grid of runs and its table."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpeer.errors import ConfigError
from kvpeer.lab.fleet.compare import render_versus, versus
from kvpeer.lab.fleet.grid import capacity_rps, run_at_load, specs, summary, trace_facts
from kvpeer.lab.fleet.params import ENGINES, LINKS
from kvpeer.lab.fleet.world import BOUNDS, POLICIES, FleetSpec, run_fleet
from kvpeer.lab.trace.mooncake import MOONCAKE_BLOCK_TOKENS, read_trace
from kvpeer.lab.trace.scaling import TraceScale, fit_context, scale_trace

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
    parser.add_argument("--ahead", action=argparse.BooleanOptionalAction, default=True,
                        help="tiers pull ahead: the router's prefetch starts a pull when it "
                             "sends the request (the router's default for a kvpeer tier)")
    parser.add_argument("--engine", default="h100", choices=sorted(ENGINES),
                        help="the engines' cost figures: h100 (Llama-3.1-8B, datasheet "
                             "arithmetic) or cpu-pair (this machine's two vllm serve CPU "
                             "engines, measured: docs/fleet.md)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="play the trace at its timestamps x this instead of at --load "
                             "(as kvpeer bench trace --time-scale)")
    parser.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                        help="tokens per trace id (kvpeer bench trace: 32)")
    parser.add_argument("--context", type=int, default=None,
                        help="fit every request to an engine context of this many tokens "
                             "(as kvpeer bench trace fits them to 2048)")
    parser.add_argument("--measured", default=None, metavar="BENCH.json",
                        help="print the model's p50/p90 TTFT beside kvpeer bench trace --json's")
    parser.add_argument("--calibrate", default=None, nargs="+", metavar="BENCH.json",
                        help="print the cpu-pair preset's figures from the probes of one or "
                             "more kvpeer bench trace --probe --json results (instead of "
                             "running)")
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
    if args.calibrate:
        return _calibration(args.calibrate)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as saved:
            result: dict[str, Any] = json.load(saved)
    else:
        result = _run(args, progress)
    if args.measured:
        with open(args.measured, encoding="utf-8") as saved:
            result["versus_measured"] = versus(result, json.load(saved))
    if args.plot:
        from kvpeer.lab.fleet.plot import plot

        plot(result, Path(args.plot))
        progress(f"plot written to {args.plot}")
    return result


def _calibration(paths: list[str]) -> dict[str, Any]:
    from kvpeer.lab.fleet.calibrate import calibrate, pooled_probe
    from kvpeer.lab.fleet.params import CPU_PAIR_SHAPE

    probes: dict[str, Any] = {}
    for path in paths:
        with open(path, encoding="utf-8") as saved:
            bench = json.load(saved)
        probes.update({f"{path}:{arm}": p for arm, p in bench.get("probes", {}).items()})
    probe = pooled_probe(probes)
    return {"calibration": calibrate(probe, CPU_PAIR_SHAPE).figures(), "probe": probe,
            "bench": paths}


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
    requests = scale_trace(read_trace(args.trace), TraceScale(
        args.block_tokens, args.time_scale or 1.0, args.window_start, args.window))
    if args.context is not None:
        requests = [fit_context(r, args.context) for r in requests]
    if len(requests) < 2:
        raise ConfigError(f"--trace {args.trace}: fewer than 2 requests in the window")
    gpu = ENGINES[args.engine]
    base = FleetSpec(seed=args.seed, slo_s=args.slo, event_delay_s=args.event_delay, gpu=gpu,
                     held_sync=args.held_sync, ahead=args.ahead)
    timed = args.time_scale is not None  # the trace's own arrivals, scaled
    if timed:
        span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
        per_engine = len(requests) / span_s / capacity_rps(requests, gpu) if span_s > 0 else 0.0
        loads = [per_engine]  # the offered load of one engine; a fleet's is this / engines
    runs: list[dict[str, Any]] = []
    ordered = [p for p in ("pooled", "infinite") if p in policies] + [
        p for p in policies if p not in BOUNDS]
    for load in loads:
        pooled: dict[tuple[int, str], float] = {}
        for spec in specs(engines, links, ordered, base):
            progress(f"{spec.engines} engines, {spec.policy}, {spec.link}, load {load:g}")
            if timed:
                result, offered = run_fleet(spec, requests), load / spec.engines
            else:
                result, offered = run_at_load(spec, requests, load), load
            if spec.policy == "pooled":
                pooled[(spec.engines, spec.link)] = result.reuse
            row = summary(result, offered, pooled.get((spec.engines, spec.link),
                                                   pooled.get((spec.engines, links[0]))))
            runs.append(row)
            if args.runs_log:
                with open(args.runs_log, "a", encoding="utf-8") as log:
                    log.write(json.dumps(row) + "\n")
    return {"trace": str(args.trace), "window_s": args.window,
            "window_start_s": args.window_start, "gpu": gpu.name, "engine": args.engine,
            "time_scale": args.time_scale, "block_tokens": args.block_tokens,
            "context": args.context, "facts": trace_facts(requests, gpu), "runs": runs}


def render(result: dict[str, Any]) -> str:
    if "calibration" in result:
        sources = ", ".join(result["bench"])
        return "\n".join([f"cpu-pair figures from the probes of {sources}:"] + [
            f"  {name:<26} {value:.6g}" for name, value in result["calibration"].items()])
    facts = result["facts"]
    lines = [
        f"{result['trace']}: {facts['requests']} requests, infinite-cache reuse "
        f"{100 * facts['infinite_reuse']:.1f} % of blocks "
        f"({100 * facts['infinite_reuse_full_blocks']:.1f} % of full blocks); "
        f"{result['gpu']}: {facts['capacity_rps_per_engine']:.2f} req/s per engine "
        "at no reuse",
        "",
        f"{'eng':>4} {'load':>5} {'policy':<11} {'link':<7} {'p50 s':>7} {'p90 s':>7} "
        f"{'p99 s':>7} {'good':>6} {'reuse':>6} {'/pool':>6} {'pulls':>6} {'GB moved':>9} "
        f"{'us/dec':>7}",
    ]
    for r in result["runs"]:
        vs = r.get("reuse_vs_pooled", math.nan)
        link = r["link"] if r["policy"] not in ("load", "affinity") else "-"
        policy = r["policy"]
        if policy == "kvpeer":
            policy += ("+hs" if r.get("held_sync") else "") + ("+a" if r.get("ahead") else "")
        lines.append(
            f"{r['engines']:>4} {r['load']:>5.2f} {policy:<11} {link:<7} "
            f"{r['ttft_p50_s']:>7.3f} {r['ttft_p90_s']:>7.3f} {r['ttft_p99_s']:>7.3f} "
            f"{100 * r['goodput']:>5.1f}% {100 * r['reuse']:>5.1f}% {100 * vs:>5.0f}% "
            f"{r['pulls']:>6} {r['bytes_moved'] / 1e9:>9.1f} "
            f"{r['router_cpu_us_per_decision']:>7.0f}"
        )
    if "versus_measured" in result:
        lines += ["", "predicted (the model) against measured (kvpeer bench trace), TTFT s:",
                  render_versus(result["versus_measured"])]
    return "\n".join(lines)
