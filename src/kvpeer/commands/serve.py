"""``kvpeer serve``: a standalone node backed by host memory."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpeer.commands.options import add_node_options, tier_config
from kvpeer.errors import KVPeerError

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
    if args.malloc_arenas:
        # The node owns this process: cap the arenas before its threads start.
        cap_malloc_arenas(args.malloc_arenas)
    config = tier_config(args)
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
