"""docs/commands.md against the CLI: every command the CLI has is in the table, and every
flag the table shows for a command is one its parser takes (issue 39: docs checked
against the code, as the config tables are)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvpeer.cli import BENCHES, COMMANDS, LABS, build_parser

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| `(kvpeer [^`]*)`")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def documented() -> dict[tuple[str, ...], set[str]]:
    """Each row's command words and the flags its synopsis shows."""
    found: dict[tuple[str, ...], set[str]] = {}
    for line in (ROOT / "docs" / "commands.md").read_text().splitlines():
        row = ROW.match(line)
        if row is None:
            continue
        for synopsis in re.findall(r"`(kvpeer [^`]*)`", line.split(" | ")[0]):
            words = [w for w in synopsis.split()[1:] if re.fullmatch(r"[a-z][a-z-]*", w)]
            command = tuple(words[:2] if words and words[0] in ("bench", "lab") else words[:1])
            flags = set(re.findall(r"(--[a-z][a-z-]*)", synopsis))
            found.setdefault(command, set()).update(flags)
    return found


def test_every_command_is_documented_with_flags_its_parser_takes() -> None:
    parser = build_parser()
    top = subparsers(parser)
    docs = documented()
    expected = {(name,) for name in COMMANDS} | {("bench", name) for name in BENCHES} | {
        ("lab", name) for name in LABS}
    assert expected <= set(docs), sorted(expected - set(docs))
    for command, flags in docs.items():
        sub = top[command[0]]
        if len(command) == 2:
            sub = subparsers(sub)[command[1]]
        known = {option for action in sub._actions for option in action.option_strings}
        assert flags <= known, (command, sorted(flags - known))
