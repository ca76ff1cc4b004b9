"""No code path may wait with ``select()``: it fails for descriptors past 1023, which a
node under a connection flood reaches (issue 15). ``poll``/``epoll`` have no such cap."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpeer"


def _select_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "select"
            and isinstance(node.value, ast.Name)
            and node.value.id == "select"
        ):
            lines.append(node.lineno)
    return lines


def test_no_module_calls_select_select() -> None:
    found = {
        str(path.relative_to(SRC)): lines
        for path in sorted(SRC.rglob("*.py"))
        if (lines := _select_calls(path))
    }
    assert found == {}, f"select.select() used at {found}"
