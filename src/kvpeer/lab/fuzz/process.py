"""The node under test: a ``kvpeer serve`` subprocess, watched from outside.

What the fuzzer may know about the node is what an operator can see: whether the
process lives, its exit status, its log, and ``/proc/<pid>`` (resident memory,
open file descriptors, threads, mappings). Nothing here talks to the node.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CRASH_MARKERS", "Death", "NodeProcess", "Usage", "deaths_in"]

#: Log lines that mean something died in the node (its driver, or any thread).
CRASH_MARKERS = (
    "driver thread crashed",
    "driver crashed",
    "Traceback (most recent call last)",
    "Exception in thread",
    "Fatal Python error",
)

_START_TIMEOUT_S = 120.0  # imports and NIXL/UCX set-up on a busy 2-core machine


@dataclass(frozen=True, slots=True)
class Usage:
    """What the node holds, read from ``/proc``."""

    rss_bytes: int
    fds: int
    threads: int

    def to_json(self) -> dict[str, int]:
        return {"rss_bytes": self.rss_bytes, "fds": self.fds, "threads": self.threads}


_LOG_RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d|[EWIF]\d{4} \d\d:)")
_THREAD = re.compile(r"^Exception in thread (.+):$")
_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in (\S+)')
#: An exception line: a class name (maybe dotted) ending like one, then its message.
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning|Crashed)(:|$)")


@dataclass(frozen=True, slots=True)
class Death:
    """One crash the node logged: its driver (``driver``), another thread (``thread``),
    the process's uncaught exception on its way out after a driver crash (``exit``), or
    the process itself with no traceback (``process``)."""

    kind: str
    thread: str  # the dead thread's name, digits blanked ("" for the driver)
    exception: str  # the exception line
    where: str  # innermost frame in kvpeer's code ("file.py:function")
    traceback: str

    @property
    def signature(self) -> str:
        if self.kind == "process":  # no traceback: its last words are all there is
            return f"process: {self.exception}"
        kind = self.exception.split(":", 1)[0]
        who = f"{self.kind} {self.thread}".strip()
        return f"{who}: {kind} at {self.where}" if self.where else f"{who}: {kind}"


def _death(kind: str, thread: str, lines: list[str]) -> Death:
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    last = lines[starts[-1] :] if starts else lines
    exception = next((line.strip() for line in last[1:] if _EXCEPTION.match(line)), "")
    frames = [m for m in (_FRAME.match(line) for line in last) if m]
    ours = [m for m in frames if "/kvpeer/" in m.group(1)] or frames
    where = f"{Path(ours[-1].group(1)).name}:{ours[-1].group(2)}" if ours else ""
    end = len(lines)
    if exception in lines:  # drop what came after the exception line
        end = max(i for i, line in enumerate(lines) if line.strip() == exception) + 1
    thread = re.sub(r"\d+", "N", thread)
    return Death(kind, thread, exception, where, "\n".join(lines[:end]))


def deaths_in(log: str) -> list[Death]:
    """Every crash in ``log``: a thread's uncaught exception or the driver's crash,
    with its traceback (other threads' log lines interleaved with it are dropped)."""
    found: list[Death] = []
    current: tuple[str, str, list[str]] | None = None
    for line in log.splitlines():
        thread = _THREAD.match(line)
        driver = "driver crashed" in line or "driver thread crashed" in line
        if thread or (driver and _LOG_RECORD.match(line)):
            _close(current, found)
            current = ("thread", thread.group(1), []) if thread else ("driver", "", [])
            continue
        if _LOG_RECORD.match(line) or current is None:
            continue
        current[2].append(line)
    _close(current, found)
    return [d for d in found if d.exception or d.kind == "driver"]


def _close(block: tuple[str, str, list[str]] | None, found: list[Death]) -> None:
    if block is None:
        return
    kind, thread, lines = block
    if kind == "driver":
        lines, after = _split_exit(lines)
        found.append(_death(kind, thread, lines))
        if after:
            found.append(_death("exit", "", after))
        return
    found.append(_death(kind, thread, lines))


def _split_exit(lines: list[str]) -> tuple[list[str], list[str]]:
    """A driver crash's lines, and what followed its first traceback: the process's own
    uncaught exception on its way out (``kvpeer serve`` failing to clean up), if any."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    if not starts:
        return lines, []
    end = next((i for i in range(starts[0], len(lines)) if _EXCEPTION.match(lines[i])), None)
    later = [i for i in starts if end is not None and i > end]
    if end is None or not later:
        return lines, []
    return lines[: end + 1], lines[later[0] :]


class NodeProcess:
    """``kvpeer serve`` over synthetic blocks on every requested data plane."""

    def __init__(
        self,
        workdir: Path,
        *,
        planes: tuple[str, ...],
        blocks: int,
        block_len: int,
        log_level: str = "WARNING",
        name: str = "node",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self._extra_args = extra_args
        self.planes = planes
        self.blocks = blocks
        self.block_len = block_len
        self.log_path = workdir / f"{name}.log"
        self._ready = workdir / f"{name}.ready"
        self._log_level = log_level
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self.peer_id = ""

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> str:
        """Start the node and wait until it listens; its peer id."""
        self._ready.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            "kvpeer",
            "--log-level",
            self._log_level,
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--blocks",
            str(self.blocks),
            "--block-len",
            str(self.block_len),
            "--synthetic-blocks",
            str(self.blocks),
            "--data-planes",
            ",".join(self.planes),
            "--ready-file",
            str(self._ready),
        ]
        command += self._extra_args
        # UCX's own default: its errors belong in the node's log (the fuzzer may have
        # silenced them for itself, where they would corrupt --json on stdout).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        env["UCX_LOG_LEVEL"] = "warn"
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                peer_id = self._ready.read_text().strip()
                if peer_id:
                    self.peer_id = peer_id
                    return peer_id
            if not self.alive():
                break
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"the node did not start; its log:\n{self.log()[-4000:]}")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def usage(self) -> Usage:
        """Resident memory, descriptors and threads now (zeros once it is gone)."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        except (OSError, AssertionError):
            return Usage(0, 0, 0)
        rss = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        threads = re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE)
        return Usage(
            int(rss.group(1)) * 1024 if rss else 0, fds, int(threads.group(1)) if threads else 0
        )

    def mapped(self, paths: tuple[str, ...]) -> list[str]:
        """Which of ``paths`` the node has mapped into its memory right now."""
        try:
            maps = Path(f"/proc/{self.pid}/maps").read_text()
        except (OSError, AssertionError):
            return []
        return [path for path in paths if path in maps]

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def new_log(self) -> str:
        """What the node logged since the last call."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                data = log.read()
        except OSError:
            return ""
        self._log_offset += len(data)
        return data.decode(errors="replace")

    def shm_files(self) -> list[str]:
        """Its shared-memory region files still present."""
        if self._proc is None:
            return []
        return glob.glob(f"/dev/shm/kvpeer-serve-{self._proc.pid}-*")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT, as an operator's Ctrl-C; its exit status (None: it had to be killed)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                return proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return proc.returncode

    def kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if proc is not None:  # a killed node cannot remove its own region
            for path in glob.glob(f"/dev/shm/kvpeer-serve-{proc.pid}-*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
