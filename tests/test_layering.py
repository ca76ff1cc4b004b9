"""Architecture pins: the layers of docs/architecture.md, enforced.

Every module under ``src/kvpeer`` imports only what :data:`MAY_IMPORT` allows its
layer (an allow-list: a new package or a new dependency is a deliberate edit
here and in docs/architecture.md's drawing, which must match it), and the allowed
dependencies form no cycle. The sans-IO core (``kvpeer.protocol`` and
``kvpeer.session``) also imports none of the I/O, threading or clock modules
(docs/design.md section 4.1). The checks are on the source (``ast``), because the
standard library itself imports e.g. ``threading`` indirectly, so
``sys.modules`` cannot tell who imported what.
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
ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"
# What each layer may import besides itself: module names under ``kvpeer.``, each
# allowing itself and its submodules. A layer is a package under src/kvpeer or a
# top-level module; ``kvpeer`` is the package's own ``__init__`` (``__version__``).
# Every entry of a product layer is one it uses (pinned below), with the one cycle
# there was (host -> node.interface) removed: the host defines the tier interface it
# drives (kvpeer.host.interface) and the node implements it.
MAY_IMPORT: dict[str, frozenset[str]] = {
    # Entry points: argv and environment come in here, and so may the lab.
    "__main__": frozenset({"cli"}),
    "cli": frozenset({"commands", "errors"}),
    # One module per command: what each command runs; a lab tool's command runs the lab.
    "commands": frozenset(
        {"checkconfig", "config", "configschema", "errors", "lab", "metrics", "node", "router",
         "transport"}
    ),
    "sim": frozenset({"lab"}),  # python -m kvpeer.sim
    # The lab (benches, fuzzer, simulation, engine harness) may import anything below
    # the entry points; nothing but an entry point imports it.
    "lab": frozenset(
        {"checkconfig", "config", "configschema", "errors", "host", "integrations", "kvpeer",
         "metrics", "node", "protocol", "router", "session", "testing", "transport", "types"}
    ),
    # The test kit ships with the package (fake clock, in-memory network and data plane,
    # conformance suites, whole tiers on one clock) and sits above the node and the host;
    # no product layer imports it.
    "testing": frozenset(
        {"config", "errors", "host", "node", "protocol", "session", "transport", "types"}
    ),
    # The product.
    "integrations": frozenset(
        {"config", "errors", "host", "metrics", "node", "transport", "types"}
    ),
    "router": frozenset({"errors", "protocol"}),  # protocol: the prefetch it sends (ahead)
    "metrics": frozenset({"kvpeer", "node", "protocol", "session"}),
    "node": frozenset({"config", "errors", "host", "protocol", "session", "transport", "types"}),
    "host": frozenset({"session.ports", "types"}),
    "checkconfig": frozenset({"config"}),
    "configschema": frozenset({"config", "protocol", "router"}),
    "config": frozenset({"errors", "protocol", "session.settings"}),
    "transport": frozenset({"errors", "protocol", "session.ports"}),
    "session": frozenset({"errors", "protocol", "types"}),
    "protocol": frozenset({"errors"}),
    "kvpeer": frozenset({"errors", "types"}),
    "errors": frozenset(),
    "types": frozenset(),
}
ENTRY_POINTS = frozenset({"__main__", "cli", "commands", "sim"})
LAB = "lab"
TEST_KIT = "testing"
PRODUCT = frozenset(MAY_IMPORT) - ENTRY_POINTS - {LAB, TEST_KIT}


def layer_of(path: Path) -> str:
    """The layer ``path`` belongs to: its package under src/kvpeer, or its module."""
    parts = path.relative_to(SRC).parts
    if len(parts) > 1:
        return parts[0]
    return "kvpeer" if parts[0] == "__init__.py" else parts[0].removesuffix(".py")


def target_layer(name: str) -> str:
    """The layer an imported ``kvpeer...`` name belongs to."""
    parts = name.split(".")
    if len(parts) > 1 and ((SRC / parts[1]).is_dir() or (SRC / f"{parts[1]}.py").is_file()):
        return parts[1]
    return "kvpeer"  # a name from the package's own __init__


def allowed(layer: str, name: str) -> bool:
    """May a module of ``layer`` import ``name`` (absolute, under kvpeer)?"""
    if target_layer(name) == layer:
        return True
    entries = MAY_IMPORT[layer]
    if target_layer(name) == "kvpeer":
        return "kvpeer" in entries
    rest = name.removeprefix("kvpeer.")
    return any(rest == entry or rest.startswith(f"{entry}.") for entry in entries)


def all_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


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


class TestLayers:
    """Every import is one its layer may make; the layers form no cycle; docs/architecture.md
    draws exactly these layers, top-down."""

    def test_every_layer_is_listed(self) -> None:
        """A new package or top-level module needs its own line in MAY_IMPORT."""
        layers = {layer_of(path) for path in all_files()}
        assert sorted(layers - set(MAY_IMPORT)) == []
        assert "router" in layers  # guards against a path mistake

    def test_every_entry_names_a_layer(self) -> None:
        for layer, entries in MAY_IMPORT.items():
            for entry in entries:
                assert target_layer(f"kvpeer.{entry}") in MAY_IMPORT, (layer, entry)
                assert (
                    entry == "kvpeer"
                    or (SRC / entry.split(".")[0]).exists()
                    or (SRC / f"{entry}.py").is_file()
                ), (layer, entry)

    @pytest.mark.parametrize("path", all_files(), ids=file_id)
    def test_imports_are_allowed(self, path: Path) -> None:
        layer = layer_of(path)
        offending = [
            f"line {line}: {name}"
            for line, name in imported_modules(parse(path), package_of(path))
            if (name == "kvpeer" or name.startswith("kvpeer.")) and not allowed(layer, name)
        ]
        assert offending == [], f"{layer} may import only {sorted(MAY_IMPORT[layer])}"

    def test_no_cycles(self) -> None:
        """Imports point down only: the allowed dependencies form a DAG."""
        graph = {
            layer: {target_layer(f"kvpeer.{entry}") for entry in entries} - {layer}
            for layer, entries in MAY_IMPORT.items()
        }
        done: set[str] = set()

        def visit(layer: str, path: tuple[str, ...]) -> None:
            assert layer not in path, f"cycle: {' -> '.join((*path, layer))}"
            if layer in done:
                return
            for below in sorted(graph[layer]):
                visit(below, (*path, layer))
            done.add(layer)

        for layer in sorted(graph):
            visit(layer, ())

    def test_a_cycle_would_be_caught(self) -> None:
        """Control: the import check sees the cycle this list removed."""
        assert not allowed("host", "kvpeer.node.interface")
        assert allowed("node", "kvpeer.host.interface")
        assert allowed("transport", "kvpeer.session.ports.DataPlane")
        assert not allowed("transport", "kvpeer.session.peer")
        assert allowed("metrics", "kvpeer.__version__")
        assert not allowed("protocol", "kvpeer.__version__")
        assert not allowed("router", "kvpeer.lab.engines.fakeengine")
        assert not allowed("integrations", "kvpeer.lab.engines.serving")
        assert allowed("commands", "kvpeer.lab.bench.serve_bench")

    def test_the_readme_draws_these_layers_top_down(self) -> None:
        drawn = readme_layers()
        assert dict(drawn) == {layer: set(entries) for layer, entries in MAY_IMPORT.items()}
        order = [layer for layer, _ in drawn]
        for position, (layer, entries) in enumerate(drawn):
            above = set(order[:position])
            below_only = {target_layer(f"kvpeer.{entry}") for entry in entries} & above
            assert below_only == set(), f"{layer} imports {below_only}, drawn above it"


def reachable(layer: str) -> set[str]:
    """Every layer that ``layer`` may import, directly or through the layers it imports."""
    seen: set[str] = set()
    todo = [layer]
    while todo:
        for entry in MAY_IMPORT[todo.pop()]:
            below = target_layer(f"kvpeer.{entry}")
            if below not in seen:
                seen.add(below)
                todo.append(below)
    return seen


def importers_of(target: str) -> set[str]:
    """The layers whose line names ``target``."""
    return {
        layer
        for layer, entries in MAY_IMPORT.items()
        if any(target_layer(f"kvpeer.{entry}") == target for entry in entries)
    }


def kvpeer_imports(layer: str) -> list[str]:
    """Every ``kvpeer...`` name the modules of ``layer`` import."""
    return [
        name
        for path in all_files()
        if layer_of(path) == layer
        for _, name in imported_modules(parse(path), package_of(path))
        if name == "kvpeer" or name.startswith("kvpeer.")
    ]


class TestProductAndLab:
    """Product and lab apart (docs/architecture.md): benches, the fuzzer, the simulation
    and the engine harness live in ``kvpeer.lab``; the product never reaches it, nor the
    test kit; the allow-list names only what each layer uses."""

    @pytest.mark.parametrize("layer", sorted(PRODUCT))
    def test_the_product_reaches_neither_lab_nor_test_kit(self, layer: str) -> None:
        assert reachable(layer) & {LAB, TEST_KIT} == set()

    def test_only_entry_points_import_the_lab(self) -> None:
        assert importers_of(LAB) <= ENTRY_POINTS
        assert importers_of(TEST_KIT) == {LAB}

    def test_the_lab_may_import_everything_below_the_entry_points(self) -> None:
        assert MAY_IMPORT[LAB] == frozenset(MAY_IMPORT) - ENTRY_POINTS - {LAB}

    @pytest.mark.parametrize("layer", sorted(set(MAY_IMPORT) - {LAB}))
    def test_every_entry_is_used(self, layer: str) -> None:
        """A line names what its layer imports, no more: a dependency dropped from the
        code is dropped from the table (the lab's line is everything, by design)."""
        names = kvpeer_imports(layer)
        unused = sorted(
            entry
            for entry in MAY_IMPORT[layer]
            if not any(
                target_layer(name) == "kvpeer"
                if entry == "kvpeer"
                else name.removeprefix("kvpeer.") == entry
                or name.startswith(f"kvpeer.{entry}.")
                for name in names
            )
        )
        assert unused == []


def readme_layers() -> list[tuple[str, set[str]]]:
    """The layer table of docs/architecture.md, in its order: the fenced
    block whose first line starts with ``layer``; each line names layers (joined
    with ``,``) and, after two or more spaces, what they may import (``-``: nothing)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    blocks = text.split("```")[1::2]
    (block,) = [b for b in blocks if b.lstrip("\n").startswith("layer")]
    rows: list[tuple[str, set[str]]] = []
    for line in block.strip("\n").splitlines()[1:]:
        names, _, imports = line.strip().partition("  ")
        entries = {e.strip() for e in imports.split(",") if e.strip() not in ("", "-")}
        rows.extend((name.strip(), entries) for name in names.split(","))
    return rows


def test_node_does_not_import_prometheus() -> None:
    """kvpeer.metrics reads nodes and owns the Prometheus client (the node layer's
    allow-list keeps kvpeer.metrics out; this keeps the library out too)."""
    offending = [
        f"{file_id(path)} line {line}: {name}"
        for path in sorted((SRC / "node").rglob("*.py"))
        for line, name in imported_modules(parse(path), package_of(path))
        if name.startswith("prometheus_client")
    ]
    assert offending == []
