"""``kvpeer router`` as its own process, the way an operator runs it (``kvpeer soak``).

A router in a process of its own is measured on its own: its RSS and descriptors are
the router's, not shared with the load generator's clients. The process is started in
a new session (its own process group) from the router's command-line flags, is ready
when it writes its URL to ``--ready-file``, and is stopped by SIGTERM to that group
(SIGKILL after :data:`STOP_TIMEOUT_S`); nothing else is touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvpeer.router.policy import EngineSpec, Mode

__all__ = ["RouterFailed", "RouterProcess", "engine_flag"]

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class RouterFailed(RuntimeError):
    """The router exited or did not become ready; the message carries its log tail."""


def engine_flag(spec: EngineSpec) -> str:
    """``spec`` as one ``kvpeer router --engine`` value."""
    parts = [f"{spec.name}={spec.url}", f"peer={spec.peer}", f"role={spec.role.value}"]
    if spec.kv_events is not None:
        parts.append(f"kv_events={spec.kv_events}")
    if spec.kv_events_replay is not None:
        parts.append(f"kv_events_replay={spec.kv_events_replay}")
    flags = {"held": spec.serves_held, "sync_pulls": spec.sync_pulls, "ahead": spec.pulls_ahead}
    parts.extend(f"{key}={str(value).lower()}" for key, value in flags.items())  # all explicit
    return ",".join(parts)


class RouterProcess:
    """One ``kvpeer router`` process group; :attr:`url` once :meth:`start` returned."""

    def __init__(
        self,
        name: str,
        mode: Mode,
        engines: Sequence[EngineSpec],
        log_dir: Path,
        *,
        allow_pinning: bool = False,
        health_timeout_s: float | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"router-{name}.log"
        self._ready = log_dir / f"router-{name}.ready"
        command = [sys.executable, "-m", "kvpeer", "router", "--mode", mode.value,
                   "--listen", "127.0.0.1:0", "--ready-file", str(self._ready)]  # fmt: skip
        if allow_pinning:
            command.append("--allow-pinning")
        if health_timeout_s is not None:
            command += ["--health-timeout", str(health_timeout_s)]
        for spec in engines:
            command += ["--engine", engine_flag(spec)]
        self.command = command
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Start the router and wait until it listens; its URL."""
        self._ready.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not self._ready.exists() or not self._ready.read_text().strip():
            if self.process.poll() is not None:
                raise RouterFailed(f"router {self.name} exited ({self.process.returncode}): "
                                   f"{self.log_tail()}")  # fmt: skip
            if time.monotonic() > deadline:
                self.stop()
                raise RouterFailed(f"router {self.name} not ready in {timeout_s:.0f} s: "
                                   f"{self.log_tail()}")  # fmt: skip
            time.sleep(0.05)
        self.url = self._ready.read_text().strip()
        return self.url

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        return ""

    def stop(self) -> None:
        """SIGTERM the group; SIGKILL what is left after :data:`STOP_TIMEOUT_S`."""
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # a router that hung, or its children
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT_S)
        self._ready.unlink(missing_ok=True)

    def __enter__(self) -> RouterProcess:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
