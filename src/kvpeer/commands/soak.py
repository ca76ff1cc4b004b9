"""``kvpeer soak``: two engines under mixed traffic and injected faults."""

from __future__ import annotations

import argparse

HELP = ("two vllm serve engines under mixed traffic and injected faults: outputs, leaks, "
        "leftover files")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpeer.lab.bench import soak_verdict

    soak_verdict.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpeer.lab.bench import soak_run

    return soak_run.main(args)
