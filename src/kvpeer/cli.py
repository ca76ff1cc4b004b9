"""The ``kvpeer`` command: ``serve``, ``stats``, ``router``, ``bench``, ``check-config``,
``demo``, ``soak``, ``fuzz``.

Each command is a module of :mod:`kvpeer.commands` (its arguments and its run); this
module lists them, parses argv, sets up logging and signals, and maps the project's
errors to exit codes. Commands and the vLLM adapter are the only places that read argv
and environment variables.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from importlib import metadata
from types import ModuleType
from typing import NoReturn

from kvpeer.commands import (
    bench_faults,
    bench_held,
    bench_idle,
    bench_ladder,
    bench_node_scale,
    bench_router,
    bench_router_scale,
    bench_serve,
    bench_tier,
    bench_trace,
    bench_transport,
    check_config,
    demo,
    fuzz,
    lab_fleet,
    router,
    serve,
    soak,
    stats,
)
from kvpeer.errors import KVPeerError

__all__ = ["COMMANDS", "LOG_LEVELS", "build_parser", "main"]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Commands that run as servers log at INFO unless told otherwise (their start, stop and
#: what changes are what an operator reads); the others at WARNING.
INFO_BY_DEFAULT = frozenset({"router"})

#: ``kvpeer NAME`` -> its module, in ``--help`` order; ``bench`` is a group of them.
COMMANDS: dict[str, ModuleType] = {
    "serve": serve,
    "stats": stats,
    "router": router,
    "check-config": check_config,
    "demo": demo,
    "soak": soak,
    "fuzz": fuzz,
}
BENCHES: dict[str, ModuleType] = {
    "tier": bench_tier,
    "transport": bench_transport,
    "idle": bench_idle,
    "held": bench_held,
    "ladder": bench_ladder,
    "faults": bench_faults,
    "router": bench_router,
    "router-scale": bench_router_scale,
    "node-scale": bench_node_scale,
    "serve": bench_serve,
    "trace": bench_trace,
}
#: ``kvpeer lab NAME``: models and tools that run no engine.
LABS: dict[str, ModuleType] = {
    "fleet": lab_fleet,
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as the one line ``kvpeer: ...`` and exit 2."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("kvpeer").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"kvpeer: {where}{message} (see {self.prog} --help)\n")


def _log_level_option(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--log-level", type=_log_level, default=default, metavar="LEVEL",
        help=f"{', '.join(LOG_LEVELS)} (default: $KVPEER_LOG_LEVEL, else info for "
             "kvpeer router and warning for the others)",
    )


def _version() -> str:
    """The installed distribution's version (pyproject.toml's)."""
    try:
        return metadata.version("kvpeer")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvpeer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvpeer {_version()}")
    _log_level_option(parser, None)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module in COMMANDS.items():
        _add(commands, name, module)
    bench = commands.add_parser("bench", help="benchmarks with same-run baselines")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, module in BENCHES.items():
        _add(benches, name, module)
    lab = commands.add_parser("lab", help="models of fleets no machine here has")
    labs = lab.add_subparsers(dest="lab", required=True, parser_class=_Parser)
    for name, module in LABS.items():
        _add(labs, name, module)
    return parser


def _add(group: argparse._SubParsersAction[_Parser], name: str,
         module: ModuleType) -> None:  # fmt: skip
    command = group.add_parser(name, help=module.HELP)
    module.add_arguments(command)
    # also after the command (kvpeer router --log-level info); SUPPRESS keeps the one
    # given before it when this one is not
    _log_level_option(command, argparse.SUPPRESS)
    command.set_defaults(func=module.run)


def main(argv: Sequence[str] | None = None) -> int:
    # NIXL logs INFO lines to stdout (it would corrupt --json output); children
    # started by benchmarks inherit the setting.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level or os.environ.get("KVPEER_LOG_LEVEL", "")
    if not level:
        level = "INFO" if args.command in INFO_BY_DEFAULT else "WARNING"
    elif level.lower() not in LOG_LEVELS:
        print(f"kvpeer: KVPEER_LOG_LEVEL {level!r} is not one of {', '.join(LOG_LEVELS)}",
              file=sys.stderr)
        return 2
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
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
