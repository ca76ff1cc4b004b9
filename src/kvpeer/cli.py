"""The ``kvpeer`` command: ``serve``, ``router``, ``bench``, ``check-config``, ``demo``, ``soak``,
``fuzz``.

This module (with the vLLM adapter) is the only place that reads argv and
environment variables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpeer.checkconfig import check_transfer_config
from kvpeer.config import TierConfig
from kvpeer.errors import KVPeerError

if TYPE_CHECKING:
    from kvpeer.node.driver import DrivenTier

__all__ = ["main"]

DEFAULT_HASH_SEED = "vllm-none-hash"


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _size(text: str) -> int:
    """``65536``, ``64K``, ``1M``, ``4MiB`` -> bytes."""
    units = {
        "": 1,
        "K": 1024,
        "KB": 1024,
        "KIB": 1024,
        "M": 1 << 20,
        "MB": 1 << 20,
        "MIB": 1 << 20,
        "G": 1 << 30,
        "GB": 1 << 30,
        "GIB": 1 << 30,
    }
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGIB")
    unit = stripped[len(digits) :]
    if not digits.isdigit() or unit not in units:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 65536, 64K, 1M)")
    return int(digits) * units[unit]


def _tier_config(args: argparse.Namespace) -> TierConfig:
    mapping: dict[str, Any] = {}
    if args.config:
        try:
            loaded = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise KVPeerError(f"--config {args.config}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise KVPeerError(f"--config {args.config}: expected a JSON object")
        mapping.update({k: v for k, v in loaded.items() if k not in ("type", "module_path")})
    overrides = {
        "host": args.host,
        "port": args.port,
        "data_transports": args.data_planes,
        "hash_seed": args.hash_seed,
        "allowed_peers": args.allow,
        "nixl_peers": args.nixl_peer,
    }
    mapping.update({k: v for k, v in overrides.items() if v is not None})
    if args.curve_secret or args.curve_server_public or args.curve_clients:
        mapping["curve"] = {
            "server_secret_key_file": args.curve_secret,
            "server_public_key_file": args.curve_server_public,
            "client_public_keys_dir": args.curve_clients,
        }
    mapping.setdefault("hash_seed", DEFAULT_HASH_SEED)
    return TierConfig.from_dict(mapping)


def _add_node_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="JSON file with tier config keys (DESIGN.md §6)")
    parser.add_argument("--host", help="address to bind and advertise (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="control port (default 5710; 0 = any)")
    parser.add_argument("--block-len", type=_size, default=64 * 1024, help="bytes per block")
    parser.add_argument("--blocks", type=int, default=1024, help="blocks in the region")
    parser.add_argument("--data-planes", type=_csv, help="preference list, e.g. shm,tcp,nixl")
    parser.add_argument(
        "--hash-seed", help=f"prefix-hash seed peers must share (default {DEFAULT_HASH_SEED})"
    )
    parser.add_argument(
        "--allow", action="append", help="allowed peer: CIDR or host:port (repeatable)"
    )
    parser.add_argument(
        "--nixl-peer",
        action="append",
        help="peer whose NIXL metadata this node loads: CIDR or host:port (repeatable; "
        "default: the --allow list if given, else nobody)",
    )
    parser.add_argument("--curve-secret", help="CURVE: this node's secret key file")
    parser.add_argument("--curve-server-public", help="CURVE: the servers' public key file")
    parser.add_argument("--curve-clients", help="CURVE: directory of allowed client keys")


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvpeer.node.serve import serve

    config = _tier_config(args)
    return serve(
        config,
        num_blocks=args.blocks,
        block_len=args.block_len,
        synthetic_blocks=args.synthetic_blocks,
        duration_s=args.duration,
        ready_file=args.ready_file,
        attach=_metrics_server(config.host, args.metrics_port),
        out=sys.stdout,
    )


def _metrics_server(
    host: str, port: int | None
) -> Callable[[DrivenTier], Callable[[], None]] | None:
    """What serves a node's metrics on ``port`` (None: no metrics)."""
    if port is None:
        return None

    def attach(node: DrivenTier) -> Callable[[], None]:
        from kvpeer.metrics.prom import MetricsServer

        server = MetricsServer(node, host, port)
        print(f"kvpeer serve: metrics at http://{host}:{server.port}/metrics", flush=True)
        return server.close

    return attach


def _cmd_stats(args: argparse.Namespace) -> int:
    from kvpeer.metrics.view import fetch, metrics_url, peers_section, render

    target = args.metrics_url or args.target
    if not target:
        print("kvpeer stats: name HOST:PORT or --metrics-url URL", file=sys.stderr)
        return 2
    url = metrics_url(target)
    try:
        text = fetch(url)
    except OSError as exc:
        print(f"kvpeer stats: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    print(render(text, url))
    print()
    print(peers_section(url))
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from kvpeer.router import config, server

    ready = Path(args.ready_file) if args.ready_file else None
    return server.run(config.from_args(args), ready_file=ready)


def _cmd_bench_router(args: argparse.Namespace) -> int:
    from kvpeer.router import bench

    def progress(message: str) -> None:
        print(f"kvpeer bench router: {message}", file=sys.stderr, flush=True)

    spec = bench.RouterBenchSpec.from_args(args)
    result = bench.run(spec, progress)
    print(json.dumps(result) if args.json else bench.render(result))
    return 0


def _progress_of(bench: str) -> Callable[[str], None]:
    def progress(message: str) -> None:
        print(f"kvpeer bench {bench}: {message}", file=sys.stderr, flush=True)

    return progress


def _cmd_bench_router_scale(args: argparse.Namespace) -> int:
    from kvpeer.bench import router_scale

    spec = router_scale.RouterScaleSpec.from_args(args)
    result = router_scale.run(spec, _progress_of("router-scale"))
    print(json.dumps(result) if args.json else router_scale.render(result))
    return 0


def _cmd_bench_node_scale(args: argparse.Namespace) -> int:
    from kvpeer.bench import node_scale

    result = node_scale.run(node_scale.NodeScaleSpec.from_args(args), _progress_of("node-scale"))
    print(json.dumps(result) if args.json else node_scale.render(result))
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from kvpeer.bench import serve, serve_vllm
    from kvpeer.bench.serve_stats import render
    from kvpeer.demo import default_model_dir

    spec = serve.ServeBenchSpec.from_args(args)  # bad values fail before any engine starts

    def progress(message: str) -> None:
        print(f"kvpeer bench serve: {message}", file=sys.stderr, flush=True)

    result = serve_vllm.run(
        spec,
        model_dir=Path(args.model or default_model_dir(os.environ.get("XDG_CACHE_HOME"))),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        progress=progress,
    )
    if args.plot:
        from kvpeer.bench.serve_plot import plot

        plot(result.cells, Path(args.plot))
        progress(f"TTFT CDFs written to {args.plot}")
    print(json.dumps(result.to_json()) if args.json else render(
        result.cells, result.errors, result.seconds, result.setup_errors, result.logs,
        result.repeat_cells))
    if result.timelines and not args.json:
        print("\nTimelines (--trace; wall clock, from the router's send)")
        print("\n".join(result.timelines))
    return 0 if result.ok else 1


def _cmd_bench_tier(args: argparse.Namespace) -> int:
    from kvpeer.bench import tier

    print("kvpeer bench tier: measuring (in memory, no sockets)...", file=sys.stderr, flush=True)
    scraper = None
    if args.metrics:
        from kvpeer.metrics.prom import tier_scraper

        scraper = tier_scraper
    result = tier.run(quick=args.quick, scraper=scraper)
    print(json.dumps(result) if args.json else tier.render(result))
    return 0


def _cmd_bench_transport(args: argparse.Namespace) -> int:
    from kvpeer.bench import transport
    from kvpeer.transport.data.nixl import NixlBackend

    planes = tuple(args.planes or (["shm", "tcp"] + (["nixl"] if NixlBackend.available() else [])))
    unknown = sorted(set(planes) - {"shm", "tcp", "nixl"})
    if unknown:
        raise KVPeerError(f"--planes: unknown data plane(s) {unknown}; choose from shm,tcp,nixl")
    spec = (transport.BenchSpec.quick if args.quick else transport.BenchSpec.full)(planes)

    def progress(message: str) -> None:
        print(f"kvpeer bench transport: {message}", file=sys.stderr, flush=True)

    serve_metrics = None
    if args.metrics:
        from kvpeer.metrics.prom import MetricsServer

        def serve_metrics(node: DrivenTier) -> tuple[int, Callable[[], None]]:
            server = MetricsServer(node, "127.0.0.1", 0)
            return server.port, server.close

    result = transport.run(spec, progress, serve_metrics)
    print(json.dumps(result) if args.json else transport.render(result))
    return 0


def _cmd_bench_faults(args: argparse.Namespace) -> int:
    from kvpeer.bench import faults_run

    return faults_run.main(args)


def _cmd_bench_idle(args: argparse.Namespace) -> int:
    from kvpeer.bench import idle
    from kvpeer.demo import default_model_dir
    from kvpeer.transport.data.nixl import NixlBackend

    if not NixlBackend.available():  # vLLM's p2p tier, the comparison, needs it
        raise KVPeerError("kvpeer bench idle needs nixl (vLLM's p2p tier runs on it)")
    make = idle.IdleSpec.quick if args.quick else idle.IdleSpec.full
    spec = make() if args.seconds is None else make(idle_s=args.seconds)

    def progress(message: str) -> None:
        print(f"kvpeer bench idle: {message}", file=sys.stderr, flush=True)

    result = idle.run(
        spec,
        model_dir=Path(
            args.model or default_model_dir(os.environ.get("XDG_CACHE_HOME"), "tiny-llama")
        ),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        progress=progress,
    )
    print(json.dumps(result) if args.json else idle.render(result))
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    try:
        loaded = json.loads(Path(args.file).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2
    problems = check_transfer_config(loaded)
    for problem in problems:
        print(f"{args.file}: {problem}")
    if not problems:
        print(f"{args.file}: ok")
    return 1 if problems else 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvpeer import demo

    def progress(message: str) -> None:
        print(f"kvpeer demo: {message}", file=sys.stderr, flush=True)

    result = demo.run_demo(
        data_plane=args.data_plane,
        prompt_tokens=args.prompt_tokens,
        model_dir=Path(args.model or demo.default_model_dir(os.environ.get("XDG_CACHE_HOME"))),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        progress=progress,
    )
    print(json.dumps(result.to_json()) if args.json else demo.render(result))
    return 0 if result.ok else 1


def _cmd_soak(args: argparse.Namespace) -> int:
    from kvpeer.bench import soak_run

    return soak_run.main(args)


def _cmd_fuzz(args: argparse.Namespace) -> int:
    # The legitimate consumers' UCX writes its errors to stdout (an interface that
    # another test on the machine removed, say): that would corrupt the report.
    os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
    from kvpeer.fuzz import harness, report

    planes = tuple(args.data_planes or harness.available_planes())
    try:
        spec = harness.FuzzSpec(
            frames=args.frames,
            seed=args.seed,
            planes=planes,
            checkpoint_every=args.checkpoint_every,
            warmup=min(args.frames, 10_000),
            keep_going=not args.stop_on_crash,
            exclude=tuple(args.exclude or ()),
            workdir=Path(args.workdir) if args.workdir else None,
        )
    except ValueError as exc:
        raise KVPeerError(str(exc)) from exc
    if args.log_level.upper() == "WARNING":  # the legitimate consumers' goodbyes are noise
        logging.getLogger("kvpeer").setLevel(logging.ERROR)

    def progress(message: str) -> None:
        print(f"kvpeer fuzz: {message}", file=sys.stderr, flush=True)

    progress(
        f"{spec.frames:,} frames, seed {spec.seed}, data planes {','.join(planes)}; "
        "starting the node"
    )
    result = harness.run_fuzz(spec, progress, minimize=args.minimize)
    print(json.dumps(report.to_json(result)) if args.json else report.render(result))
    return 0 if result.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpeer", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=os.environ.get("KVPEER_LOG_LEVEL", "WARNING"))
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run a standalone node backed by host memory")
    _add_node_options(serve)
    serve.add_argument(
        "--synthetic-blocks", type=int, default=0, help="preload N verifiable blocks"
    )
    serve.add_argument("--duration", type=float, help="stop after this many seconds")
    serve.add_argument("--ready-file", help="write the node's peer id here once it listens")
    serve.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus kvpeer_* metrics at http://HOST:P/metrics (0 = any free port)",
    )
    serve.set_defaults(func=_cmd_serve)

    stats = commands.add_parser("stats", help="one screen of a live node, from its metrics")
    stats.add_argument("target", nargs="?", help="HOST:PORT of the metrics port, or a URL")
    stats.add_argument("--metrics-url", help="the /metrics URL (kvpeer serve or vLLM)")
    stats.set_defaults(func=_cmd_stats)

    from kvpeer.router.config import add_arguments as add_router_arguments

    router = commands.add_parser(
        "router", help="OpenAI-compatible HTTP router in front of vLLM engines (pd or shared)"
    )
    add_router_arguments(router)
    router.set_defaults(func=_cmd_router)

    bench = commands.add_parser("bench", help="benchmarks with same-run baselines")
    benches = bench.add_subparsers(dest="bench", required=True)
    tier = benches.add_parser("tier", help="tier step overhead and memory (in memory)")
    tier.add_argument("--quick", action="store_true", help="smaller counts, under a minute")
    tier.add_argument("--json", action="store_true", help="print one JSON object")
    tier.add_argument(
        "--metrics",
        action="store_true",
        help="also time each step while a thread scrapes the tier's metrics (on vs off)",
    )
    tier.set_defaults(func=_cmd_bench_tier)

    transport = benches.add_parser(
        "transport", help="data planes vs raw socket / memcpy / raw NIXL / ZMQ round trip"
    )
    transport.add_argument(
        "--planes",
        type=_csv,
        help="data planes to measure (default: shm,tcp and nixl if installed)",
    )
    transport.add_argument("--quick", action="store_true", help="a subset, under a minute")
    transport.add_argument("--json", action="store_true", help="print one JSON object")
    transport.add_argument(
        "--metrics",
        action="store_true",
        help="also measure the 1-block rtt while both nodes' /metrics are scraped (on vs off)",
    )
    transport.set_defaults(func=_cmd_bench_transport)

    idle = benches.add_parser(
        "idle", help="idle engines' CPU and lookup answer time: kvpeer vs vLLM's p2p tier"
    )
    idle.add_argument("--quick", action="store_true", help="fewer engines and lookups")
    idle.add_argument("--seconds", type=float, help="idle seconds measured (default 10; quick 4)")
    idle.add_argument("--model", help="checkpoint directory (default ~/.cache/kvpeer/tiny-llama)")
    idle.add_argument("--log-dir", help="keep the engines' logs here")
    idle.add_argument("--json", action="store_true", help="print one JSON object")
    idle.set_defaults(func=_cmd_bench_idle)

    from kvpeer.bench.faults import add_arguments as add_bench_faults_arguments

    faults = benches.add_parser(
        "faults", help="producer faults in real engines: consumer fallback time, kvpeer vs p2p"
    )
    add_bench_faults_arguments(faults)
    faults.set_defaults(func=_cmd_bench_faults)

    from kvpeer.router.bench import add_arguments as add_bench_router_arguments

    bench_router = benches.add_parser(
        "router", help="router overhead: added latency and requests/s vs a direct baseline"
    )
    add_bench_router_arguments(bench_router)
    bench_router.set_defaults(func=_cmd_bench_router)

    from kvpeer.bench.router_scale import add_arguments as add_router_scale_arguments

    router_scale = benches.add_parser(
        "router-scale",
        help="router data layer vs fleet size: event intake CPU, index memory, decision time",
    )
    add_router_scale_arguments(router_scale)
    router_scale.set_defaults(func=_cmd_bench_router_scale)

    from kvpeer.bench.node_scale import add_arguments as add_node_scale_arguments

    node_scale = benches.add_parser(
        "node-scale",
        help="one node with 127 peer sessions: idle CPU and memory per session, lookups at once",
    )
    add_node_scale_arguments(node_scale)
    node_scale.set_defaults(func=_cmd_bench_node_scale)

    from kvpeer.bench.serve import add_arguments as add_bench_serve_arguments

    bench_serve = benches.add_parser(
        "serve",
        help="TTFT under a workload through kvpeer router: no tier vs kvpeer vs vLLM's p2p tier",
    )
    add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(func=_cmd_bench_serve)

    check = commands.add_parser(
        "check-config",
        help="validate a vLLM kv_transfer_config (or one kvpeer tier entry) JSON file",
    )
    check.add_argument("file")
    check.set_defaults(func=_cmd_check_config)

    demo = commands.add_parser(
        "demo",
        help="two vllm serve engines behind kvpeer router share KV over HTTP (pd, shared, chat)",
    )
    demo.add_argument(
        "--data-plane", default="shm", help="shm (default), tcp or nixl: the plane both use"
    )
    demo.add_argument(
        "--prompt-tokens", type=int, default=1536, help="prompt length (64..1536, default 1536)"
    )
    demo.add_argument("--model", help="checkpoint directory (default ~/.cache/kvpeer/serve-llama)")
    demo.add_argument("--log-dir", help="keep the engines' logs here (default: kept on failure)")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=_cmd_demo)
    from kvpeer.bench.soak import add_arguments as add_soak_arguments

    soak = commands.add_parser(
        "soak",
        help="two vllm serve engines under mixed traffic and injected faults: outputs, "
        "leaks, leftover files",
    )
    add_soak_arguments(soak)
    soak.set_defaults(func=_cmd_soak)
    fuzz = commands.add_parser(
        "fuzz", help="drive a real node with generated hostile frames and watch it"
    )
    fuzz.add_argument(
        "--frames", type=int, default=1_000_000, help="frames to send (default 1,000,000)"
    )
    fuzz.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    fuzz.add_argument(
        "--data-planes",
        type=_csv,
        help="the node's planes (default: shm,tcp; a nixl node trusts no fuzz peer)",
    )
    fuzz.add_argument(
        "--checkpoint-every",
        type=int,
        default=25_000,
        help="frames between checks of the node and legitimate pulls (default 25,000)",
    )
    fuzz.add_argument(
        "--exclude",
        action="append",
        help="a case label prefix or scenario not to send, e.g. a known crash (repeatable)",
    )
    fuzz.add_argument(
        "--stop-on-crash", action="store_true", help="stop at the first crash (default: restart)"
    )
    fuzz.add_argument(
        "--minimize", action="store_true", help="shrink each crash to a short reproducer"
    )
    fuzz.add_argument("--workdir", help="keep the node's logs here (default: kept on failure)")
    fuzz.add_argument("--json", action="store_true", help="print one JSON object")
    fuzz.set_defaults(func=_cmd_fuzz)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # NIXL logs INFO lines to stdout (it would corrupt --json output); children
    # started by benchmarks inherit the setting.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    # KVPEER_TRACE=1: the router's one line per request (kvpeer.node.trace); never otherwise
    traced = os.environ.get("KVPEER_TRACE", "") in ("1", "true", "yes")
    logging.getLogger("kvpeer.trace").setLevel(logging.INFO if traced else logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)
    # Ctrl-C stops every command, even one started where SIGINT is ignored (a shell
    # starts background jobs that way, and children inherit it): a node an operator
    # or a supervisor interrupts must stop and clean up, not keep running.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return int(args.func(args))
    except KVPeerError as exc:
        print(f"kvpeer: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
