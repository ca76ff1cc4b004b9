"""``kvpeer bench tier``: the tier's step overhead and memory, in memory."""

from __future__ import annotations

import argparse
import json

from kvpeer.commands.progress import progress_printer

HELP = "tier step overhead and memory (in memory)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller counts, under a minute")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="also time each step while a thread scrapes the tier's metrics (on vs off)",
    )


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import tier_bench

    progress_printer("bench tier")("measuring (in memory, no sockets)...")
    scraper = None
    if args.metrics:
        from kvpeer.metrics.prom import tier_scraper

        scraper = tier_scraper
    result = tier_bench.run(quick=args.quick, scraper=scraper)
    print(json.dumps(result) if args.json else tier_bench.render(result))
    return 0
