"""The CLI imports only the module of the command it runs: ``kvpeer serve`` loads no lab,
bench or router code (issue 41: the product apart from the lab, at run time too)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

PROBE = """
import sys
from kvpeer.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(sorted(m for m in sys.modules if m.startswith(('kvpeer.lab', 'kvpeer.router',
      'kvpeer.commands.'))))
"""


def loaded(*argv: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    result: list[str] = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("argv", "own"),
    [
        (("serve", "--help"), "serve"),
        (("--log-level", "info", "stats", "--help"), "stats"),
        (("check-config", "--help"), "check_config"),
    ],
)
def test_a_product_command_loads_no_other_command_and_no_lab(
    argv: tuple[str, ...], own: str
) -> None:
    modules = loaded(*argv)
    assert f"kvpeer.commands.{own}" in modules
    others = [m for m in modules if m.startswith("kvpeer.commands.")
              and m not in (f"kvpeer.commands.{own}", "kvpeer.commands.options",
                            "kvpeer.commands.progress")]  # fmt: skip
    assert others == []
    assert not [m for m in modules if m.startswith("kvpeer.lab")]


def test_kvpeer_serve_loads_no_router_code() -> None:
    assert not [m for m in loaded("serve", "--help") if m.startswith("kvpeer.router")]


def test_a_bench_loads_the_lab_and_the_top_level_help_lists_every_command() -> None:
    assert any(m.startswith("kvpeer.lab") for m in loaded("bench", "router", "--help"))
    listed = subprocess.run([sys.executable, "-m", "kvpeer", "--help"], capture_output=True,
                            text=True, timeout=120, check=True).stdout  # fmt: skip
    for name in ("serve", "stats", "router", "check-config", "demo", "bench", "lab"):
        assert name in listed
