"""``kvpeer stats``: one screen of a live node, from its metrics."""

from __future__ import annotations

import argparse
import sys

HELP = "one screen of a live node, from its metrics"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", nargs="?", help="HOST:PORT of the metrics port, or a URL")
    parser.add_argument("--metrics-url", help="the /metrics URL (kvpeer serve or vLLM)")


def run(args: argparse.Namespace) -> int:
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
