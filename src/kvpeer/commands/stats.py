"""``kvpeer stats``: one screen of a live node (or router), from its metrics."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "one screen of a live node (or router), from its metrics"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", nargs="?", help="HOST:PORT of the metrics port, or a URL")
    parser.add_argument("--metrics-url", help="the /metrics URL (kvpeer serve, vLLM, kvpeer "
                        "router)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: kind (node or router), url, every "
                             "kvpeer sample, and a node's /peers")


def run(args: argparse.Namespace) -> int:
    from kvpeer.metrics import peers, routerscreen
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
    try:
        page = routerscreen.samples(text)
    except ValueError as exc:
        print(f"kvpeer stats: {url} is not a Prometheus metrics page: {exc}", file=sys.stderr)
        return 1
    kind = routerscreen.kind(page)
    if kind is None:
        print(f"kvpeer stats: no kvpeer metrics at {url}", file=sys.stderr)
        return 1
    if args.json:
        document: dict[str, Any] = {"kind": kind, "url": url, "metrics": page}
        if kind == routerscreen.NODE:
            try:
                document["peers"] = peers.fetch_peers(peers.peers_url(url))
            except (peers.PeersUnavailable, OSError) as exc:
                document["peers"] = None
                document["peers_unavailable"] = str(exc)
        print(json.dumps(document, indent=2, sort_keys=True))
        return 0
    if kind == routerscreen.ROUTER:
        print(routerscreen.render(page, url))
        return 0
    print(render(text, url))
    print()
    print(peers_section(url))
    return 0
