"""``kvpeer bench faults``: producer faults in real engines, kvpeer vs vLLM's p2p tier."""

from __future__ import annotations

import argparse

HELP = "producer faults in real engines: consumer fallback time, kvpeer vs p2p"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpeer.lab.bench import faults

    faults.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import faults_run

    return faults_run.main(args)
