"""Every common mistake at the command line is one line, ``kvpeer: ...``, naming the value,
and exit 2; never a traceback (issue 39, item 6). Each row runs the real command in a
process of its own, as an operator would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ENGINE = "--engine=e=http://127.0.0.1:9,peer=127.0.0.1:5710"


@contextmanager
def listening() -> Iterator[int]:
    """A port something already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def kvpeer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpeer", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})}, check=False,
    )


def bad_files(tmp_path: Path) -> dict[str, str]:
    latin = tmp_path / "latin1.json"
    latin.write_bytes(b'{"hash_seed": "caf\xe9"}')
    toml = tmp_path / "latin1.toml"
    toml.write_bytes(b'mode = "caf\xe9"\n')
    return {"json": str(latin), "toml": str(toml)}


# (id, argv (with {json}, {toml}, {port}, {missing} filled in), what the line must name)
CASES = [
    ("serve --blocks 0", ["serve", "--blocks", "0"], "--blocks 0"),
    ("serve --block-len 0", ["serve", "--block-len", "0"], "--block-len 0"),
    ("synthetic blocks beyond the region",
     ["serve", "--blocks", "8", "--synthetic-blocks", "9"], "--synthetic-blocks 9"),
    ("an allocation the machine cannot give",
     ["serve", "--blocks", "1048576", "--block-len", "1G"], "--blocks x --block-len"),
    ("serve ready file in a missing folder", ["serve", "--ready-file", "{missing}"],
     "{missing}"),
    ("router ready file in a missing folder",
     ["router", ENGINE, "--ready-file", "{missing}"], "{missing}"),
    ("serve non-UTF-8 config", ["serve", "--config", "{json}"], "{json}: not UTF-8"),
    ("router non-UTF-8 config", ["router", "--config", "{toml}"], "{toml}: not UTF-8"),
    ("check-config non-UTF-8 tier config", ["check-config", "{json}"], "{json}: "),
    ("check-config non-UTF-8 router config", ["check-config", "{toml}"], "{toml}: not UTF-8"),
    ("router port in use", ["router", ENGINE, "--listen", "127.0.0.1:{port}"],
     "listen 127.0.0.1:{port}"),
    ("metrics port in use",
     ["serve", "--port", "0", "--blocks", "4", "--block-len", "4K", "--metrics-port", "{port}"],
     "--metrics-port {port}"),
    ("log level after the command", ["router", ENGINE, "--log-level", "FOO"], "'FOO'"),
    ("log level before the command", ["--log-level", "FOO", "stats", "h:1"], "'FOO'"),
    ("a size that is not one", ["serve", "--block-len", "12Q"], "'12Q'"),
    ("a wildcard event endpoint",
     ["router", ENGINE + ",kv_events=tcp://*:5557"], "kv_events 'tcp://*:5557'"),
    ("a negative drain", ["router", ENGINE, "--drain-timeout", "-1"], "-1"),
    ("an unknown command", ["sevre"], "'sevre'"),
]


@pytest.mark.parametrize(("argv", "named"), [(c[1], c[2]) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_naming_the_value_and_exit_2(
    argv: list[str], named: str, tmp_path: Path
) -> None:
    files = bad_files(tmp_path)
    missing = str(tmp_path / "no-such-folder" / "ready")
    with listening() as port:
        values = {**files, "port": str(port), "missing": missing}
        done = kvpeer(*(arg.format(**values) for arg in argv))
    named = named.format(**values)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvpeer: "), lines[0]
    assert named in lines[0], lines[0]
    assert done.returncode == 2, done.stderr


def test_a_bad_log_level_in_the_environment_is_named() -> None:
    done = kvpeer("stats", "h:1", env={"KVPEER_LOG_LEVEL": "loud"})
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "kvpeer: KVPEER_LOG_LEVEL 'loud' is not one of debug, info, warning, error, critical"
    )


def test_version_and_a_log_level_after_the_command() -> None:
    version = kvpeer("--version")
    assert version.returncode == 0
    assert version.stdout.startswith("kvpeer 0.")
    # accepted after the command too (before, argparse refused it there)
    done = kvpeer("check-config", "--log-level", "debug", "/nonexistent.json")
    assert "unrecognized arguments" not in done.stderr
    assert done.returncode == 2
