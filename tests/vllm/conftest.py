"""Fixtures of the real-vLLM tests: the tiny checkpoint and engine subprocesses.

Each engine scenario runs ``tests/vllm/engine.py`` in its own process (vLLM on CPU
forces ``spawn`` and keeps process-wide state). Independent scenarios start together
so their imports and start-up overlap on the machine's cores; ``KVPEER_VLLM_JOBS``
caps how many scenarios run at once (default: the number of cores, at most 3;
``1`` runs them one after another).

Every engine gets a unique ``engine_id``; whatever happens, the module's finalizer
stops the processes still running and removes the
``/dev/shm/vllm_offload_<engine_id>.mmap`` files they left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvpeer.integrations.vllm.model import ensure_tiny_llama
from tests.vllm.engine import RESULT_MARKER

ENGINE_SCRIPT = Path(__file__).with_name("engine.py")
SHM_DIR = Path("/dev/shm")
ENGINE_TIMEOUT_S = 600.0
LOG_TAIL_CHARS = 6000
MAX_JOBS = 3

T = TypeVar("T")


@dataclass(frozen=True)
class Generation:
    """One ``generate`` of a scenario: greedy tokens, their logprobs, cached prompt tokens."""

    tokens: list[int]
    logprobs: list[float]
    num_cached_tokens: int

    def max_logprob_delta(self, other: Generation) -> float:
        return max(abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True))


@dataclass(frozen=True)
class EngineOutcome:
    """What ``engine.py`` printed: generations by label, file counts, step timings."""

    engine_id: str
    runs: dict[str, Generation]
    files: dict[str, int]
    seconds: dict[str, float]


def engine_env(*, multiprocessing: bool) -> dict[str, str]:
    """The environment of an engine subprocess (DESIGN.md section 9)."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0",
        # Concurrent engines must not all pin their OpenMP thread to the same core.
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    return env


def shm_files(engine_id: str) -> list[Path]:
    """The primary-region files vLLM maps for ``engine_id``."""
    return sorted(SHM_DIR.glob(f"vllm_offload_{engine_id}*.mmap"))


class EngineLauncher:
    """Runs engine scenarios as subprocesses, several at once, and cleans up after them."""

    def __init__(self, model: Path, log_dir: Path, jobs: int) -> None:
        self.model = model
        self._log_dir = log_dir
        self._pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="engine")
        self._lock = threading.Lock()
        self._processes: list[subprocess.Popen[bytes]] = []
        self._engine_ids: list[str] = []
        self._closed = False

    def new_engine_id(self) -> str:
        engine_id = f"kvpeer-test-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._engine_ids.append(engine_id)
        return engine_id

    def submit(self, chain: Callable[[], T]) -> Future[T]:
        """Run ``chain`` (which calls :meth:`run` one or more times) in the background."""
        return self._pool.submit(chain)

    def run(self, scenario: dict[str, Any], *, multiprocessing: bool) -> EngineOutcome:
        """Run one scenario to completion; fail with its log tail if it fails."""
        engine_id = scenario["engine_id"]
        log_path = self._log_dir / f"{engine_id}.log"
        with log_path.open("wb") as log, self._lock:
            if self._closed:
                raise RuntimeError("launcher closed")
            process = subprocess.Popen(
                [sys.executable, str(ENGINE_SCRIPT), json.dumps(scenario)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_env(multiprocessing=multiprocessing),
                # Its own process group, so the EngineCore and worker processes that
                # vLLM spawns can be stopped with it.
                start_new_session=True,
            )
            self._processes.append(process)
        try:
            returncode = process.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.wait()
            raise AssertionError(
                f"engine {engine_id} timed out after {ENGINE_TIMEOUT_S:.0f} s\n{_tail(log_path)}"
            ) from None
        output = log_path.read_text(encoding="utf-8", errors="replace")
        results = [line for line in output.splitlines() if line.startswith(RESULT_MARKER)]
        if returncode != 0 or not results:
            raise AssertionError(f"engine {engine_id} exited with {returncode}\n{_tail(log_path)}")
        raw = json.loads(results[-1][len(RESULT_MARKER) :])
        return EngineOutcome(
            engine_id=engine_id,
            runs={label: Generation(**run) for label, run in raw["runs"].items()},
            files=raw["files"],
            seconds=raw["seconds"],
        )

    def close(self) -> list[Path]:
        """Stop what still runs, remove the engines' shm files; return those removed."""
        with self._lock:
            self._closed = True
            processes = list(self._processes)
        for process in processes:
            # A script that did not exit cleanly may have left vLLM processes behind.
            if process.poll() != 0:
                _kill_group(process)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        self._pool.shutdown(wait=True, cancel_futures=True)
        removed: list[Path] = []
        for engine_id in self._engine_ids:
            for path in shm_files(engine_id):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
        return removed


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group led by ``process`` (its own session, see ``run``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _tail(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    return text[-LOG_TAIL_CHARS:]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama checkpoint every engine of the session loads."""
    return ensure_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def launcher(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineLauncher]:
    default_jobs = max(1, min(MAX_JOBS, os.cpu_count() or 1))
    jobs = int(os.environ.get("KVPEER_VLLM_JOBS", str(default_jobs)))
    engines = EngineLauncher(tiny_llama, tmp_path_factory.mktemp("engine-logs"), jobs)
    try:
        yield engines
    finally:
        engines.close()
