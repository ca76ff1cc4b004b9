"""Nodes in subprocesses: :class:`NodeProcess`, started as ``kvpeer serve``
(:func:`start_serve`) or as the PD producer program of ``producer.py``
(:func:`start_producer`)."""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvpeer.node.params import split_peer_id
from tests.net.common import BLOCK_LEN, DEADLINE_S, START_DEADLINE_S, unique_shm_path, wait_until

__all__ = [
    "NodeProcess",
    "StartNode",
    "start_producer",
    "start_serve",
]

#: What the ``serve`` and ``producer`` fixtures are: ``start(**kwargs) -> NodeProcess``.
StartNode = Callable[..., "NodeProcess"]
REPO = Path(__file__).resolve().parents[2]


class NodeProcess:
    """A node running in a subprocess; :meth:`stop` always leaves nothing behind."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        log_path: Path,
        shm_patterns: Sequence[str],
    ) -> None:
        self.proc = proc
        self.log_path = log_path
        self.peer_id = ""
        self.ready_file: Path | None = None  # kvpeer serve writes its peer id here
        self._shm_patterns = list(shm_patterns)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        address = split_peer_id(self.peer_id)
        assert address is not None
        return address[1]

    def _announced_id(self) -> str:
        if self.ready_file is not None:
            with contextlib.suppress(OSError):
                return self.ready_file.read_text().strip()
            return ""
        for line in self.log().splitlines():  # the producer program prints it
            if line.startswith("peer "):
                return line.removeprefix("peer ").strip()
        return ""

    def wait_ready(self, timeout_s: float = START_DEADLINE_S) -> str:
        """Wait until the node listens; its peer id (stops it and raises if it never does)."""
        try:
            wait_until(
                lambda: split_peer_id(self._announced_id()) is not None or not self.alive(),
                timeout_s,
            )
            peer_id = self._announced_id()
            if split_peer_id(peer_id) is None:
                raise RuntimeError(f"node process did not start:\n{self.log()}")
        except BaseException:
            self.stop()
            raise
        self.peer_id = peer_id
        return peer_id

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL and reap (the kernel closes its sockets; its files stay behind)."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(DEADLINE_S)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def stop(self) -> None:
        """Ask it to stop (stdin closed, SIGTERM), SIGKILL if it does not; remove its files."""
        try:
            if self.alive():
                with contextlib.suppress(OSError, ValueError):
                    if self.proc.stdin is not None:
                        self.proc.stdin.close()
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGCONT)  # in case a test stopped it
                    self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(DEADLINE_S)
            elif self.proc.stdin is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.proc.stdin.close()
        finally:
            for pattern in self._shm_patterns:
                for path in glob.glob(pattern.format(pid=self.proc.pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)

    def wait_for_output(self, text: str, timeout_s: float = DEADLINE_S) -> bool:
        return wait_until(lambda: text in self.log() or not self.alive(), timeout_s) and (
            text in self.log()
        )


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _launch(
    command: list[str],
    workdir: Path,
    name: str,
    shm_patterns: Sequence[str],
    netns: str | None = None,
) -> NodeProcess:
    """Start ``command``; inside network namespace ``netns`` if given (``ip netns exec``
    execs it, so the process is the node itself)."""
    log_path = workdir / f"{name}.log"
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_environment(),
            cwd=str(REPO),
        )
    return NodeProcess(proc, log_path, shm_patterns)


def _write_config(workdir: Path, name: str, config: Mapping[str, object] | None) -> list[str]:
    if not config:
        return []
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(dict(config)))
    return ["--config", str(path)]


def start_serve(
    workdir: Path,
    *,
    plane: str = "tcp",
    blocks: int = 64,
    block_len: int = BLOCK_LEN,
    synthetic: int = 64,
    host: str = "127.0.0.1",
    port: int = 0,
    config: Mapping[str, object] | None = None,
    args: Sequence[str] = (),
    wait: bool = True,
    netns: str | None = None,
    trust_local_nixl: bool = True,
) -> NodeProcess:
    """``kvpeer serve`` with ``synthetic`` preloaded blocks; returns once it listens
    (inside network namespace ``netns`` if given). With nixl it loads the NIXL
    metadata of local peers unless ``trust_local_nixl`` is False (then of nobody)."""
    name = f"serve-{uuid.uuid4().hex[:8]}"
    if "nixl" in plane.split(",") and trust_local_nixl:
        args = ["--nixl-peer", "127.0.0.0/8", *args]
    ready = workdir / f"{name}.ready"
    command = [
        sys.executable,
        "-m",
        "kvpeer",
        "--log-level",
        "INFO",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--blocks",
        str(blocks),
        "--block-len",
        str(block_len),
        "--synthetic-blocks",
        str(synthetic),
        "--data-planes",
        plane,
        "--ready-file",
        str(ready),
        *_write_config(workdir, name, config),
        *args,
    ]
    node = _launch(command, workdir, name, ["/dev/shm/kvpeer-serve-{pid}-*"], netns)
    node.ready_file = ready
    if wait:
        node.wait_ready()
    return node


def start_producer(
    workdir: Path,
    *,
    kv_request_ids: Sequence[str],
    count: int,
    plane: str = "tcp",
    block_len: int = BLOCK_LEN,
    batches: int = 1,
    interval_s: float = 0.0,
    delay_s: float = 0.0,
    host: str = "127.0.0.1",
    port: int = 0,
    config: Mapping[str, object] | None = None,
    wait: bool = True,
    netns: str | None = None,
) -> NodeProcess:
    """A PD producer process (``python -m tests.net.producer``) storing synthetic blocks
    ``0..count-1`` for each of ``kv_request_ids`` in ``batches``, ``interval_s`` apart,
    after ``delay_s``; returns once it listens (with ``wait``), inside network
    namespace ``netns`` if given."""
    name = f"producer-{uuid.uuid4().hex[:8]}"
    shm_path = unique_shm_path("producer") if plane == "shm" else ""
    command = [
        sys.executable,
        "-m",
        "tests.net.producer",
        "producer",
        *itertools.chain.from_iterable(("--kv-request-id", i) for i in kv_request_ids),
        "--count",
        str(count),
        "--plane",
        plane,
        "--block-len",
        str(block_len),
        "--batches",
        str(batches),
        "--interval",
        str(interval_s),
        "--delay",
        str(delay_s),
        "--host",
        host,
        "--port",
        str(port),
        "--shm-path",
        shm_path,
        *_write_config(workdir, name, config),
    ]
    node = _launch(command, workdir, name, [shm_path] if shm_path else [], netns)
    if wait:
        node.wait_ready()
    return node
