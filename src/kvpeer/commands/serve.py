"""``kvpeer serve``: a standalone node backed by host memory."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvpeer.commands.options import add_node_options, ready_file_option, tier_config
from kvpeer.errors import ConfigError, KVPeerError

if TYPE_CHECKING:
    from kvpeer.node.driver import DrivenTier

HELP = "run a standalone node backed by host memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_options(parser)
    parser.add_argument(
        "--synthetic-blocks", type=int, default=0, help="preload N verifiable blocks"
    )
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    parser.add_argument("--ready-file", help="write the node's peer id here once it listens")
    parser.add_argument(
        "--malloc-arenas",
        type=int,
        default=1,
        help="cap glibc's malloc arenas in this process (default 1; 0: glibc's default, "
        "8 per core; kvpeer.node.trim)",
    )
    parser.add_argument(
        "--no-heap-trim",
        action="store_true",
        help="keep freed heap memory in the process (default: the driver hands it back "
        "once resident memory grew 8 MiB; kvpeer.node.trim)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus kvpeer_* metrics at http://HOST:P/metrics (0 = any free port)",
    )


def run(args: argparse.Namespace) -> int:
    from kvpeer.node.serve import serve
    from kvpeer.node.trim import cap_malloc_arenas

    if args.malloc_arenas < 0:
        raise KVPeerError(f"--malloc-arenas: must be >= 0, got {args.malloc_arenas}")
    _check_region(args)
    ready_file_option(args.ready_file)
    config = tier_config(args)
    _check_memory(args.blocks * args.block_len, "shm" in config.data_transports)
    if args.malloc_arenas:
        # The node owns this process: cap the arenas before its threads start.
        cap_malloc_arenas(args.malloc_arenas)
    return serve(
        config,
        num_blocks=args.blocks,
        block_len=args.block_len,
        synthetic_blocks=args.synthetic_blocks,
        duration_s=args.duration,
        ready_file=args.ready_file,
        attach=_metrics_server(config.host, args.metrics_port),
        trim_heap=not args.no_heap_trim,
        out=sys.stdout,
    )


def _check_region(args: argparse.Namespace) -> None:
    """The region's shape, each bad value named (before anything is allocated)."""
    if args.blocks < 1:
        raise ConfigError(f"--blocks {args.blocks}: the region needs at least one block")
    if args.block_len < 1:
        raise ConfigError(f"--block-len {args.block_len}: a block needs at least one byte")
    if not 0 <= args.synthetic_blocks <= args.blocks:
        raise ConfigError(
            f"--synthetic-blocks {args.synthetic_blocks}: must be within 0..{args.blocks} "
            "(the region's --blocks)"
        )


def _check_memory(size: int, shm: bool) -> None:
    """Refuse a region the machine cannot give now (its pages are touched at start: too
    large an anonymous region ends in the OOM killer, a /dev/shm one in SIGBUS)."""
    available = _available_bytes()
    where = "memory available"
    if shm:
        try:
            stat = os.statvfs("/dev/shm")
        except OSError:
            pass
        else:
            free = stat.f_bavail * stat.f_frsize
            if available is None or free < available:
                available, where = free, "free in /dev/shm (the shm data plane's region)"
    if available is not None and size > available:
        raise ConfigError(
            f"--blocks x --block-len = {_gib(size)}: more than the {_gib(available)} {where} "
            "on this machine"
        )


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _metrics_server(
    host: str, port: int | None
) -> Callable[[DrivenTier], Callable[[], None]] | None:
    """What serves a node's metrics on ``port`` (None: no metrics)."""
    if port is None:
        return None

    def attach(node: DrivenTier) -> Callable[[], None]:
        from kvpeer.metrics.prom import MetricsServer

        try:
            server = MetricsServer(node, host, port)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: {exc.strerror or exc}") from exc
        print(f"kvpeer serve: metrics at http://{host}:{server.port}/metrics", flush=True)
        return server.close

    return attach
