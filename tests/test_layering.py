"""Architecture pins: the sans-IO core does no I/O, starts no threads, reads no clock.

``kvpeer.protocol`` and ``kvpeer.session`` import none of the I/O, threading or clock
modules, and import only the layers beneath them (DESIGN.md section 4.1). The check is
on the source (``ast``), because the standard library itself imports e.g. ``threading``
indirectly, so ``sys.modules`` cannot tell who imported what.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpeer"
CORE_PACKAGES = ("protocol", "session")
FORBIDDEN_MODULES = frozenset(
    {
        "zmq",
        "socket",
        "threading",
        "asyncio",
        "time",
        "select",
        "selectors",
        "os",
        "subprocess",
        "multiprocessing",
    }
)
# Layers above each core package (imports point down only).
HIGHER_LAYERS: dict[str, frozenset[str]] = {
    "protocol": frozenset(
        {"session", "node", "metrics", "transport", "testing", "cli", "integrations", "tier",
         "fuzz"}
    ),
    "session": frozenset(
        {"node", "metrics", "transport", "testing", "cli", "integrations", "tier", "fuzz"}
    ),
}
# The fuzzer sits with bench and cli: it drives a real node from outside and may use
# what a node is built of, never the sans-IO session core directly, nor test helpers.
FUZZ_MAY_IMPORT = frozenset(
    {"fuzz", "node", "protocol", "transport", "config", "host", "errors", "types"}
)


def core_files() -> list[Path]:
    """Every .py file of the sans-IO packages."""
    return sorted(path for package in CORE_PACKAGES for path in (SRC / package).rglob("*.py"))


def file_id(path: Path) -> str:
    """A short test id for ``path``."""
    return str(path.relative_to(SRC))


def imported_modules(tree: ast.AST, package: str = "") -> list[tuple[int, str]]:
    """(line, absolute name) of every import in ``tree``, a module of ``package``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def package_of(path: Path) -> str:
    """The dotted package that contains ``path``."""
    return ".".join(["kvpeer", *path.relative_to(SRC).parts[:-1]])


def parse(path: Path) -> ast.Module:
    """The syntax tree of ``path``."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


class TestSansIOCore:
    """protocol/ and session/ stay free of I/O, threads and clocks."""

    def test_core_files_found(self) -> None:
        """Guard against a path mistake making every other check vacuous."""
        names = {file_id(path) for path in core_files()}
        assert "protocol/codec.py" in names
        assert "session/peer.py" in names

    @pytest.mark.parametrize("path", core_files(), ids=file_id)
    def test_no_forbidden_imports(self, path: Path) -> None:
        """No ``import X`` / ``from X import`` of an I/O, thread or clock module."""
        offending = [
            f"line {line}: {name}"
            for line, name in imported_modules(parse(path), package_of(path))
            if name.split(".")[0] in FORBIDDEN_MODULES
        ]
        assert offending == []

    @pytest.mark.parametrize("path", core_files(), ids=file_id)
    def test_no_time_calls(self, path: Path) -> None:
        """No ``time.<anything>`` reference: time is an argument (``now``)."""
        offending = [
            f"line {node.lineno}: time.{node.attr}"
            for node in ast.walk(parse(path))
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "time"
        ]
        assert offending == []

    @pytest.mark.parametrize("path", core_files(), ids=file_id)
    def test_no_dynamic_imports(self, path: Path) -> None:
        """No ``__import__`` / ``importlib`` to get around the checks above."""
        tree = parse(path)
        offending = [
            f"line {node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
        ]
        offending += [
            f"line {line}: {name}"
            for line, name in imported_modules(tree, package_of(path))
            if name.split(".")[0] == "importlib"
        ]
        assert offending == []

    @pytest.mark.parametrize("path", core_files(), ids=file_id)
    def test_imports_point_down_only(self, path: Path) -> None:
        """protocol/ and session/ never import the layers above them."""
        package = path.relative_to(SRC).parts[0]
        offending = [
            f"line {line}: {name}"
            for line, name in imported_modules(parse(path), package_of(path))
            if name.startswith("kvpeer.") and name.split(".")[1] in HIGHER_LAYERS[package]
        ]
        assert offending == []


class TestImportSideEffects:
    """Importing the core in a fresh interpreter pulls in no zmq."""

    def test_importing_core_does_not_import_zmq(self, tmp_path: Path) -> None:
        """A stand-in ``zmq`` package on the path is never imported by the core.

        The stand-in makes the check meaningful whether or not pyzmq is installed.
        """
        (tmp_path / "zmq").mkdir()
        (tmp_path / "zmq" / "__init__.py").write_text("")
        script = textwrap.dedent(
            """
            import sys
            import kvpeer.protocol
            import kvpeer.session
            print(sorted(m for m in sys.modules if m.split(".")[0] == "zmq"))
            """
        )
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(tmp_path), str(SRC.parent), os.environ.get("PYTHONPATH", "")]
            ),
        }
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]"

    def test_stand_in_zmq_is_detectable(self, tmp_path: Path) -> None:
        """Control: the probe does see an import of the stand-in (no false pass)."""
        (tmp_path / "zmq").mkdir()
        (tmp_path / "zmq" / "__init__.py").write_text("")
        script = "import sys, zmq; print(sorted(m for m in sys.modules if m == 'zmq'))"
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "['zmq']"


def test_node_does_not_import_metrics() -> None:
    """kvpeer.metrics reads nodes; nodes never know about it (it sits above node)."""
    offending = [
        f"{file_id(path)} line {line}: {name}"
        for path in sorted((SRC / "node").rglob("*.py"))
        for line, name in imported_modules(parse(path), package_of(path))
        if name.startswith("kvpeer.metrics") or name.startswith("prometheus_client")
    ]
    assert offending == []


class TestFuzzLayer:
    """kvpeer.fuzz imports only the layers it drives a node with."""

    @pytest.mark.parametrize("path", sorted((SRC / "fuzz").rglob("*.py")), ids=file_id)
    def test_fuzz_imports_allowed_layers_only(self, path: Path) -> None:
        offending = [
            f"line {line}: {name}"
            for line, name in imported_modules(parse(path), package_of(path))
            if name.startswith("kvpeer.") and name.split(".")[1] not in FUZZ_MAY_IMPORT
        ]
        assert offending == []

    def test_nothing_below_imports_the_fuzzer(self) -> None:
        below = [
            path
            for path in SRC.rglob("*.py")
            if path.relative_to(SRC).parts[0] not in ("fuzz", "cli.py")
        ]
        offending = [
            f"{file_id(path)} line {line}: {name}"
            for path in below
            for line, name in imported_modules(parse(path), package_of(path))
            if name.startswith("kvpeer.fuzz")
        ]
        assert offending == []
