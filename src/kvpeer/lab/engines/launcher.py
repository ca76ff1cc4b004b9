"""Run vLLM engine scenarios as subprocesses, several at once, and clean up after them.

Each scenario (see :mod:`kvpeer.lab.engines.runner`) runs in its own process
group (vLLM on CPU forces ``spawn`` and keeps process-wide state; the group also
holds the EngineCore and worker processes vLLM spawns). Engines that talk to each
other run at the same time: :meth:`EngineLauncher.run_together` starts them together
and, as soon as one fails, stops the others (which would otherwise wait for it until
their own timeouts) and reports every log tail. :meth:`EngineLauncher.close` stops
whatever still runs and removes the ``/dev/shm/vllm_offload_<engine_id>.mmap`` files
the engines left. ``kvpeer demo`` and the real-vLLM tests use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvpeer.host.claims import CLAIM_PREFIX
from kvpeer.lab.engines.runner import RESULT_MARKER, STEP_MARKER

RUNNER = "kvpeer.lab.engines.runner"
SHM_DIR = Path("/dev/shm")
ENGINE_TIMEOUT_S = 600.0
LOG_TAIL_CHARS = 6000
PARTNER_LOG_TAIL_CHARS = 3000
MAX_JOBS = 3
POLL_S = 0.1
PROGRESS_S = 5.0  # how often run_together reports what the engines do

T = TypeVar("T")


@dataclass(frozen=True)
class Generation:
    """One ``generate`` of a scenario: greedy tokens, their logprobs, cached prompt
    tokens, the wall and CPU seconds (of the engine's processes) the call took, vLLM's
    time to first token, and the blocks and bytes kvpeer loaded from peers meanwhile
    (``None`` where unknown: see :mod:`kvpeer.lab.engines.runner`)."""

    tokens: list[int]
    logprobs: list[float]
    num_cached_tokens: int
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    ttft_s: float | None = None
    blocks_from_peer: int | None = None
    bytes_from_peer: int | None = None
    load_seconds: float | None = None
    #: the engine's scheduler steps during the call, and the kvpeer promotions and
    #: host loads that took no extra step (kvpeer.integrations.vllm.manager, .connector)
    engine_steps: int | None = None
    sync_promotions: int | None = None
    late_promotions: int | None = None
    sync_loads: int | None = None

    def max_logprob_delta(self, other: Generation) -> float:
        return max(abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True))


@dataclass(frozen=True)
class Hold:
    """One ``hold`` step: how long the engine waited, and the CPU seconds its processes
    used meanwhile, in all and by process name (e.g. ``VLLM::EngineCor``: Linux keeps
    15 characters)."""

    seconds: float
    cpu_seconds: float
    cpu_seconds_by_process: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineOutcome:
    """What the runner printed: generations and holds by label, file counts, step
    timings; and where its whole log is."""

    engine_id: str
    runs: dict[str, Generation]
    files: dict[str, int]
    seconds: dict[str, float]
    holds: dict[str, Hold] = field(default_factory=dict)
    log_path: Path | None = None
    longest_stall_s: float = 0.0  # longest stretch the runner process did not run


@dataclass(frozen=True)
class RunningEngine:
    """An engine scenario started by :meth:`EngineLauncher.start`."""

    engine_id: str
    process: subprocess.Popen[bytes]
    log_path: Path


def engine_env(*, multiprocessing: bool) -> dict[str, str]:
    """The environment of an engine subprocess (docs/design.md section 9)."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0",
        # Concurrent engines must not all pin their OpenMP thread to the same core.
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    return env


#: Ports handed out for a later bind come from below the kernel's ephemeral range
#: (32768-60999 by default): a port the kernel picked for us is picked again for the
#: next outbound connection, and an engine that binds it a second later finds it taken.
_PORTS = range(20000, 32000)


class _PortOrder:
    """The range in one random order per process, walked as a cycle: a port handed out
    is not handed out again by this process until every other one has been. Free *now*
    is not enough: two engines given ports in turn bind them only seconds later, so a
    second draw from the whole range could return the first engine's port (a fleet of
    two engines draws eight; CI once gave both engines the same tier port). A forked
    child draws its own order, or it would walk the parent's."""

    def __init__(self) -> None:
        self._shuffle()
        os.register_at_fork(after_in_child=self._shuffle)

    def _shuffle(self) -> None:
        self._order = list(_PORTS)
        random.SystemRandom().shuffle(self._order)
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            port = self._order[self._next]
            self._next = (self._next + 1) % len(self._order)
            return port


_PORT_ORDER = _PortOrder()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, outside the ephemeral range, and not one
    this process has handed out recently (see :class:`_PortOrder`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(200):
        port = _PORT_ORDER.take()
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1} on {host}")


def shm_files(engine_id: str) -> list[Path]:
    """The primary-region files vLLM maps for ``engine_id``, and kvpeer's claims on them."""
    region = f"vllm_offload_{engine_id}*.mmap"
    return sorted([*SHM_DIR.glob(region), *SHM_DIR.glob(f"{CLAIM_PREFIX}{region}")])


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

    def new_engine_id(self, prefix: str = "kvpeer-test") -> str:
        engine_id = f"{prefix}-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._engine_ids.append(engine_id)
        return engine_id

    def submit(self, chain: Callable[[], T]) -> Future[T]:
        """Run ``chain`` (which calls :meth:`run` one or more times) in the background."""
        return self._pool.submit(chain)

    def start(self, scenario: dict[str, Any], *, multiprocessing: bool) -> RunningEngine:
        """Start one scenario in the background; :meth:`finish` collects it."""
        engine_id = scenario["engine_id"]
        log_path = self._log_dir / f"{engine_id}.log"
        with log_path.open("wb") as log, self._lock:
            if self._closed:
                raise RuntimeError("launcher closed")
            process = subprocess.Popen(
                [sys.executable, "-m", RUNNER, json.dumps(scenario)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_env(multiprocessing=multiprocessing),
                # Its own process group, so the EngineCore and worker processes that
                # vLLM spawns can be stopped with it.
                start_new_session=True,
            )
            self._processes.append(process)
        return RunningEngine(engine_id, process, log_path)

    def run(self, scenario: dict[str, Any], *, multiprocessing: bool) -> EngineOutcome:
        """Run one scenario to completion; fail with its log tail if it fails."""
        (outcome,) = self.run_together([(scenario, multiprocessing)])
        return outcome

    def run_together(
        self,
        scenarios: Sequence[tuple[dict[str, Any], bool]],
        progress: Callable[[str], None] | None = None,
        names: Sequence[str] = (),
    ) -> list[EngineOutcome]:
        """Run ``(scenario, multiprocessing)`` pairs at once; their outcomes in order.

        As soon as one engine fails (or all run past ``ENGINE_TIMEOUT_S``), the others
        are stopped and the failure is raised with every engine's log tail. Every
        ``PROGRESS_S`` seconds ``progress`` (if given) gets one line saying what each
        engine (called by ``names``, else by engine id) is doing.
        """
        engines = [self.start(scenario, multiprocessing=mp) for scenario, mp in scenarios]
        labels = list(names) or [engine.engine_id for engine in engines]
        started = time.monotonic()
        deadline = started + ENGINE_TIMEOUT_S
        next_report = started + PROGRESS_S
        failed: RunningEngine | None = None
        timed_out = False
        while failed is None:
            running = [e for e in engines if e.process.poll() is None]
            failed = next((e for e in engines if e.process.returncode not in (None, 0)), None)
            if failed is None and not running:
                return [self.finish(engine) for engine in engines]
            now = time.monotonic()
            if failed is None and now > deadline:
                failed, timed_out = running[0], True
            if progress is not None and now >= next_report:
                next_report = now + PROGRESS_S
                doing = ", ".join(
                    f"{label}: {current_step(e)}" for label, e in zip(labels, engines, strict=True)
                )
                progress(f"{now - started:4.0f} s  {doing}")
            if failed is None:
                time.sleep(POLL_S)
        for engine in engines:
            if engine.process.poll() is None:
                _kill_group(engine.process)
                engine.process.wait()
        what = (
            f"timed out after {ENGINE_TIMEOUT_S:.0f} s"
            if timed_out
            else f"exited with {failed.process.returncode}"
        )
        partners = "".join(
            f"\n--- partner {e.engine_id} (exit {e.process.returncode}) ---\n"
            f"{log_excerpt(e.log_path, PARTNER_LOG_TAIL_CHARS)}"
            for e in engines
            if e is not failed
        )
        raise AssertionError(
            f"engine {failed.engine_id} {what}\n{log_excerpt(failed.log_path)}{partners}"
        )

    def finish(self, engine: RunningEngine) -> EngineOutcome:
        """The outcome of an engine that exited successfully, parsed from its log."""
        engine.process.wait()
        output = engine.log_path.read_text(encoding="utf-8", errors="replace")
        results = [line for line in output.splitlines() if line.startswith(RESULT_MARKER)]
        if engine.process.returncode != 0 or not results:
            raise AssertionError(
                f"engine {engine.engine_id} exited with {engine.process.returncode}\n"
                f"{log_excerpt(engine.log_path)}"
            )
        raw = json.loads(results[-1][len(RESULT_MARKER) :])
        return EngineOutcome(
            engine_id=engine.engine_id,
            runs={label: _generation(run) for label, run in raw["runs"].items()},
            files=raw["files"],
            seconds=raw["seconds"],
            holds={label: Hold(**hold) for label, hold in raw.get("holds", {}).items()},
            log_path=engine.log_path,
            longest_stall_s=float(raw.get("longest_stall_s", 0.0)),
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


def _generation(raw: dict[str, Any]) -> Generation:
    counts = {
        k: None if raw[k] is None else int(raw[k]) for k in ("blocks_from_peer", "bytes_from_peer")
    }
    return Generation(**{**raw, **counts})


def current_step(engine: RunningEngine) -> str:
    """What the engine announced last (``starting`` before it said anything;
    ``done`` once it exited)."""
    if engine.process.poll() is not None:
        return "done" if engine.process.returncode == 0 else f"exit {engine.process.returncode}"
    step = "starting"
    with contextlib.suppress(OSError):
        text = engine.log_path.read_text(encoding="utf-8", errors="replace")
        for line in text.splitlines():
            if line.startswith(STEP_MARKER):
                step = line[len(STEP_MARKER) :].strip()
    return step


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group led by ``process`` (its own session, see ``run``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


#: A Python exception's last traceback line, after any log prefix vLLM puts before it
#: (``(EngineCore pid=1) ERROR 12-05 09:02:52 [core.py:1510] ``).
_RAISED = re.compile(r"(?:^|\] )((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b: .*)$")
RAISED_SHOWN = 4


def log_excerpt(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of an engine's log, led by the first exceptions raised anywhere in it: the
    API server's traceback fills a tail while the EngineCore's root cause sits far above
    it (a bind that failed, a region too small)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    raised: list[str] = []
    for line in text.splitlines():
        found = _RAISED.search(line)
        if found and found.group(1) not in raised:
            raised.append(found.group(1))
            if len(raised) == RAISED_SHOWN:
                break
    if not raised:
        return text[-chars:]
    first = "".join(f"  {r}\n" for r in raised)
    return f"exceptions raised, first {len(raised)}:\n{first}end of the log:\n{text[-chars:]}"

