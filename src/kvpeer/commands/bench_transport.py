"""``kvpeer bench transport``: data planes against raw socket, memcpy, NIXL and ZMQ."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpeer.commands.options import csv
from kvpeer.commands.progress import progress_printer
from kvpeer.errors import KVPeerError

if TYPE_CHECKING:
    from kvpeer.node.driver import DrivenTier

HELP = "data planes vs raw socket / memcpy / raw NIXL / ZMQ round trip"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--planes",
        type=csv,
        help="data planes to measure (default: shm,tcp and nixl if installed)",
    )
    parser.add_argument("--quick", action="store_true", help="a subset, under a minute")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="also measure the 1-block rtt while both nodes' /metrics are scraped (on vs off)",
    )


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import transport
    from kvpeer.transport.data.nixl import NixlBackend

    planes = tuple(args.planes or (["shm", "tcp"] + (["nixl"] if NixlBackend.available() else [])))
    unknown = sorted(set(planes) - {"shm", "tcp", "nixl"})
    if unknown:
        raise KVPeerError(f"--planes: unknown data plane(s) {unknown}; choose from shm,tcp,nixl")
    spec = (transport.BenchSpec.quick if args.quick else transport.BenchSpec.full)(planes)

    progress = progress_printer("bench transport")

    serve_metrics = None
    if args.metrics:
        from kvpeer.metrics.prom import MetricsServer

        def serve_metrics(node: DrivenTier) -> tuple[int, Callable[[], None]]:
            server = MetricsServer(node, "127.0.0.1", 0)
            return server.port, server.close

    result = transport.run(spec, progress, serve_metrics)
    print(json.dumps(result) if args.json else transport.render(result))
    return 0
