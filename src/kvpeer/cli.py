"""The ``kvpeer`` command: ``serve``, ``stats``, ``router``, ``bench``, ``check-config``,
``demo``, ``soak``, ``fuzz``.

Each command is a module of :mod:`kvpeer.commands` (its arguments and its run); this
module lists them, parses argv, sets up logging and signals, and maps the project's
errors to exit codes. Commands and the vLLM adapter are the only places that read argv
and environment variables.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import NoReturn

from kvpeer import commands as command_modules
from kvpeer.errors import KVPeerError

__all__ = ["COMMANDS", "LOG_LEVELS", "build_parser", "main"]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Commands that run as servers log at INFO unless told otherwise (their start, stop and
#: what changes are what an operator reads); the others at WARNING.
INFO_BY_DEFAULT = frozenset({"router"})

#: ``kvpeer NAME`` -> its module in :mod:`kvpeer.commands`, in ``--help`` order. Modules
#: are imported only when their command runs (or ``--help`` lists them all), so ``kvpeer
#: serve`` loads no router, bench or lab code.
COMMANDS: dict[str, str] = {
    "serve": "serve",
    "stats": "stats",
    "router": "router",
    "check-config": "check_config",
    "demo": "demo",
    "soak": "soak",
    "fuzz": "fuzz",
}
BENCHES: dict[str, str] = {
    "tier": "bench_tier",
    "transport": "bench_transport",
    "idle": "bench_idle",
    "held": "bench_held",
    "ladder": "bench_ladder",
    "faults": "bench_faults",
    "router": "bench_router",
    "router-scale": "bench_router_scale",
    "node-scale": "bench_node_scale",
    "serve": "bench_serve",
    "trace": "bench_trace",
    "corun": "bench_corun",
}
#: ``kvpeer lab NAME``: models and tools that run no engine.
LABS: dict[str, str] = {
    "fleet": "lab_fleet",
}
#: ``kvpeer GROUP NAME``: (the group's help, its commands).
GROUPS: dict[str, tuple[str, dict[str, str]]] = {
    "bench": ("benchmarks with same-run baselines", BENCHES),
    "lab": ("models of fleets no machine here has", LABS),
}
#: Top-level commands that are lab tools (every ``bench`` and ``lab`` command is one).
LAB_TOOLS = frozenset({"demo", "soak", "fuzz"})
LAB_MISSING = ("is a lab tool, and this installation has no lab (kvpeer's wheel carries the "
               "product only): run it from a checkout of kvpeer (pip install -e .)")


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


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. With ``argv``, only the command it names is built (its
    module imported); the others are listed by name only."""
    chosen = _chosen(argv) if argv is not None else None
    parser = _Parser(prog="kvpeer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvpeer {_version()}")
    _log_level_option(parser, None)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module in COMMANDS.items():
        _add(commands, name, module, full=chosen is None or chosen[0] == name)
    for group, (text, members) in GROUPS.items():
        if chosen is not None and chosen[0] != group:
            commands.add_parser(group)
            continue
        sub = commands.add_parser(group, help=text)
        subs = sub.add_subparsers(dest=group, required=True, parser_class=_Parser)
        for name, module in members.items():
            wanted = chosen is None or chosen[1] is None or chosen[1] == name
            _add(subs, name, module, full=wanted, where=f"{group} {name}")
    return parser


def _chosen(argv: Sequence[str]) -> tuple[str, str | None] | None:
    """The command (and a group's subcommand) ``argv`` names, or None when it names none
    it knows or asks for the top-level help or version (then everything is built)."""
    words: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token in ("-h", "--help", "--version") and not words:
            return None
        if token == "--log-level":
            next(tokens, None)  # its value
        elif not token.startswith("-"):
            words.append(token)
            if len(words) == 2 or words[0] not in GROUPS:
                break
    if not words or (words[0] not in COMMANDS and words[0] not in GROUPS):
        return None
    return words[0], (words[1] if len(words) > 1 else None)


def _add(group: argparse._SubParsersAction[_Parser], name: str, module_name: str, *,
         full: bool, where: str | None = None) -> None:  # fmt: skip
    """Command ``name`` of ``group``: built from its module (``full``), or only named; a
    lab tool where the lab is not installed answers that it is not."""
    if not full:
        group.add_parser(name)
        return
    if (where is not None or name in LAB_TOOLS) and not _has_lab():
        group.add_parser(name, help="(a lab tool: not in this installation)")
        return  # main() answers before parsing (_lab_tool)
    module = importlib.import_module(f"{command_modules.__name__}.{module_name}")
    command = group.add_parser(name, help=module.HELP)
    module.add_arguments(command)
    # also after the command (kvpeer router --log-level info); SUPPRESS keeps the one
    # given before it when this one is not
    _log_level_option(command, argparse.SUPPRESS)
    command.set_defaults(func=module.run)


def _has_lab() -> bool:
    return importlib.util.find_spec("kvpeer.lab") is not None


def _lab_tool(chosen: tuple[str, str | None] | None) -> str | None:
    """The chosen command's name if it is a lab tool (``bench serve``, ``demo``)."""
    if chosen is None:
        return None
    command, sub = chosen
    if command in GROUPS:
        return f"{command} {sub}" if sub is not None else command
    return command if command in LAB_TOOLS else None


def main(argv: Sequence[str] | None = None) -> int:
    # NIXL logs INFO lines to stdout (it would corrupt --json output); children
    # started by benchmarks inherit the setting.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    words = sys.argv[1:] if argv is None else list(argv)
    tool = _lab_tool(_chosen(words))
    if tool is not None and not _has_lab():
        print(f"kvpeer: {tool} {LAB_MISSING}", file=sys.stderr)
        return 2
    parser = build_parser(words)
    args = parser.parse_args(words)
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
