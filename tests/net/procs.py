"""Helpers of the real-network tests, and the programs they run as subprocesses.

In the test process: :class:`LocalNode` (a node over its own :class:`BlockPool`,
driven the way an engine would: symmetric pulls and PD loads), :class:`ServingNode`
(a node serving synthetic blocks through a :class:`TieringHost` stepped by a thread),
:class:`RawPeer` (a hand-driven ZMQ peer that sends whatever a test wants) and
:class:`NodeProcess` (a ``kvpeer serve`` or PD producer subprocess).

As a program, ``python tests/net/procs.py producer ...`` runs a PD producer: it
prints its peer id, stores synthetic blocks for one or more ``remote_decoder``
requests (in batches, so a transfer can be made to last), finishes them and keeps
serving until its stdin closes or it gets SIGTERM. The program imports only
kvpeer and the standard library.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import zmq

from kvpeer.config import TierConfig
from kvpeer.host import BlockPool, TieringHost
from kvpeer.integrations.vllm import launcher
from kvpeer.node.build import open_node
from kvpeer.node.driver import DrivenTier
from kvpeer.node.params import split_peer_id
from kvpeer.node.pull import Puller, PullResult
from kvpeer.node.serve import preload_synthetic
from kvpeer.node.synthetic import synthetic_block, synthetic_index, synthetic_key
from kvpeer.node.tier import TierStatistics
from kvpeer.protocol import (
    PROTOCOL_VERSION,
    AckExtension,
    Codec,
    Connect,
    ConnectAck,
    ConnectExtension,
    Message,
    TransportChoice,
    UnknownMessage,
)
from kvpeer.testing.expect import record_once
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.types import Key, LookupResult, RequestContext, TransferJob

__all__ = [
    "BLOCK_LEN",
    "DEADLINE_S",
    "HASH_SEED",
    "LocalNode",
    "NodeProcess",
    "PdLoad",
    "RawPeer",
    "ServingNode",
    "SilentListener",
    "StartNode",
    "cpu_seconds",
    "free_port",
    "keys_of",
    "plane_params",
    "start_producer",
    "start_serve",
    "wait_until",
]

HASH_SEED = "vllm-none-hash"
BLOCK_LEN = 64 * 1024
#: Upper bound of every wait in these tests.
DEADLINE_S = 10.0
#: Starting a node process (imports, NIXL/UCX set-up) on a busy 2-core machine.
START_DEADLINE_S = 60.0
PROCS = Path(__file__).resolve()
SHM_PREFIX = "/dev/shm/kvpeer-nettest-"

M = TypeVar("M", bound=Message)
#: What the ``serve`` and ``producer`` fixtures are: ``start(**kwargs) -> NodeProcess``.
StartNode = Callable[..., "NodeProcess"]


# -- small helpers ------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = DEADLINE_S, interval_s: float = 0.01
) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, outside the kernel's ephemeral range."""
    return launcher.free_port(host)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plane_params() -> list[object]:
    """Every data plane as pytest parameters; nixl is skipped only where it is missing."""
    import pytest

    from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend

    nixl = pytest.param(
        "nixl", marks=pytest.mark.skipif(not NixlBackend.available(), reason=INSTALL_HINT)
    )
    return ["tcp", "shm", nixl]


def keys_of(indexes: Sequence[int]) -> list[Key]:
    return [synthetic_key(i) for i in indexes]


def unique_shm_path(tag: str) -> str:
    return f"{SHM_PREFIX}{os.getpid()}-{tag}-{uuid.uuid4().hex[:8]}"


def tier_config(
    plane: str | Sequence[str], host: str = "127.0.0.1", port: int = 0, **overrides: object
) -> TierConfig:
    planes = [plane] if isinstance(plane, str) else list(plane)
    mapping: dict[str, object] = {
        "host": host,
        "port": port,
        "data_transports": planes,
        "hash_seed": HASH_SEED,
    }
    if "nixl" in planes:
        mapping["nixl_peers"] = ["127.0.0.0/8"]  # every node of these tests is local
    mapping.update(overrides)
    return TierConfig.from_dict(mapping)


# -- nodes in the test process ------------------------------------------------------------


def open_pool_node(
    tag: str,
    plane: str | Sequence[str],
    num_blocks: int,
    block_len: int,
    host: str,
    port: int,
    settings: Mapping[str, object],
    *,
    synthetic: int = 0,
) -> tuple[BlockPool, DrivenTier]:
    """A region (shm-backed when the shm plane is on) and a node over it."""
    planes = [plane] if isinstance(plane, str) else list(plane)
    shm_path = unique_shm_path(tag) if "shm" in planes else None
    pool = BlockPool(num_blocks, block_len, shm_path=shm_path)
    try:
        preload_synthetic(pool, synthetic)
        region = PrimaryRegion(pool.view, num_blocks, block_len, pool.shm_path)
        # Nodes of this process (a test may run two) may map each other's shm regions.
        config = tier_config(planes, host, port, **settings)
        return pool, open_node(config, region, shm_same_process=True)
    except BaseException:
        pool.close()
        raise


class LocalNode:
    """A node in the test process over its own pool; it pulls like an engine would.

    Every job result goes through :meth:`collect`, so PD loads never lose each
    other's results (:class:`Puller` keeps only its own: do not overlap the two).
    """

    def __init__(
        self,
        plane: str | Sequence[str] = "tcp",
        *,
        num_blocks: int = 64,
        block_len: int = BLOCK_LEN,
        host: str = "127.0.0.1",
        port: int = 0,
        config: Mapping[str, object] | None = None,
        **overrides: object,
    ) -> None:
        """``config`` and ``overrides``: tier config keys on top of the defaults."""
        self.pool, self.node = open_pool_node(
            "node", plane, num_blocks, block_len, host, port, {**(config or {}), **overrides}
        )
        self.results: dict[int, bool] = {}
        self._job_ids = itertools.count(1)
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self.node.tier.peer_id

    def next_job_id(self) -> int:
        return next(self._job_ids)

    def pull(
        self, peer_id: str, keys: Sequence[Key], slots: Sequence[int], timeout_s: float = DEADLINE_S
    ) -> PullResult:
        """One symmetric pull (probe, then load the leading hits)."""
        puller = Puller(self.node, peer_id, job_ids_from=self.next_job_id())
        return puller.pull(keys, slots, timeout_s=timeout_s)

    def start_pd_load(
        self, peer_id: str, kv_request_id: str, keys: Sequence[Key], slots: Sequence[int]
    ) -> PdLoad:
        return PdLoad(self, peer_id, kv_request_id, keys, slots)

    def collect(self) -> None:
        for result in self.node.get_finished_jobs():
            record_once(self.results, result.job_id, result.success)

    def wait_job(self, job_id: int, timeout_s: float = DEADLINE_S) -> bool | None:
        """The job's success, or None if it did not finish within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.collect()
            if job_id in self.results:
                return self.results[job_id]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.node.wait_for_work(min(0.05, remaining))

    def statistics(self) -> TierStatistics:
        with self.node.locked():
            return self.node.tier.statistics()

    def has_session(self, peer_id: str) -> bool:
        with self.node.locked():
            return self.node.tier.session(peer_id) is not None

    def block_index(self, slot: int) -> int | None:
        """Which synthetic block slot ``slot`` holds (None: not a synthetic block)."""
        return synthetic_index(bytes(self.pool.slot_view(slot)))

    def is_zero(self, slot: int) -> bool:
        return not any(bytes(self.pool.slot_view(slot)))

    def assert_blocks(self, slots: Sequence[int], indexes: Sequence[int]) -> None:
        found = [self.block_index(slot) for slot in slots]
        assert found == list(indexes), "blocks landed in the wrong slots or corrupted"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.node.shutdown()
            with contextlib.suppress(Exception):
                self.collect()
        finally:
            self.pool.close()

    def __enter__(self) -> LocalNode:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class PdLoad:
    """One PD consumer request (``remote_prefiller``): lookups answer HIT, one load."""

    def __init__(
        self,
        owner: LocalNode,
        peer_id: str,
        kv_request_id: str,
        keys: Sequence[Key],
        slots: Sequence[int],
    ) -> None:
        address = split_peer_id(peer_id)
        assert address is not None, peer_id
        self._owner = owner
        node = owner.node
        self.context = RequestContext(
            f"decode-{kv_request_id}",
            {
                "remote_prefiller": {
                    "kv_request_id": kv_request_id,
                    "remote_host": address[0],
                    "remote_port": address[1],
                }
            },
        )
        node.on_new_request(self.context)
        self.answers = [node.lookup(key, self.context) for key in keys]
        node.on_schedule_end()
        self.job_id = owner.next_job_id()
        self.submitted_at = time.monotonic()
        #: Like an engine: load only when every lookup hit; otherwise compute locally.
        self.submitted = all(answer is LookupResult.HIT for answer in self.answers)
        if self.submitted:
            node.submit_load(TransferJob(self.job_id, tuple(keys), tuple(slots), self.context))
        self._finished = False

    def wait(self, timeout_s: float = DEADLINE_S) -> bool | None:
        """The load's success; None if it is still running after ``timeout_s``."""
        assert self.submitted, f"no load was submitted (lookups answered {self.answers})"
        return self._owner.wait_job(self.job_id, timeout_s)

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._owner.node.on_request_finished(self.context)


class ServingNode:
    """A node serving ``synthetic`` preloaded blocks; a thread steps its host.

    Only the stepping thread touches the host; tests read the tier under its lock.
    """

    def __init__(
        self,
        plane: str | Sequence[str] = "tcp",
        *,
        synthetic: int = 64,
        num_blocks: int = 64,
        block_len: int = BLOCK_LEN,
        host: str = "127.0.0.1",
        port: int = 0,
        config: Mapping[str, object] | None = None,
        **overrides: object,
    ) -> None:
        self.pool, self.node = open_pool_node(
            "serving",
            plane,
            num_blocks,
            block_len,
            host,
            port,
            {**(config or {}), **overrides},
            synthetic=synthetic,
        )
        self.host = TieringHost(self.pool, [self.node])
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-serving-host", daemon=True)
        self._thread.start()

    @property
    def peer_id(self) -> str:
        return self.node.tier.peer_id

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.node.wait_for_work(0.05)
                self.host.step()
        except BaseException as exc:  # reported by close() and the tests
            self.error = exc

    def statistics(self) -> TierStatistics:
        with self.node.locked():
            return self.node.tier.statistics()

    def has_session(self, peer_id: str) -> bool:
        with self.node.locked():
            return self.node.tier.session(peer_id) is not None

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(DEADLINE_S)
        try:
            if not self._thread.is_alive():
                self.host.shutdown()
            else:  # pragma: no cover - a hung host; still stop the node
                self.node.shutdown()
        finally:
            self.pool.close()
        if self.error is not None:
            raise AssertionError(f"the serving host failed: {self.error!r}") from self.error

    def __enter__(self) -> ServingNode:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class RawPeer:
    """A hand-driven peer: a DEALER that claims to be ``<host>:<port>`` toward a node and,
    with ``listen``, a ROUTER at that address that records what the node sends back.

    The DEALER connects from wherever the kernel picks (127.0.0.1 on loopback),
    whatever ``host`` it claims."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        target: str,
        *,
        listen: bool = True,
        host: str = "127.0.0.1",
        identity: bytes | None = None,
    ) -> None:
        self.codec = Codec()
        self.router: zmq.Socket[bytes] | None = None
        if listen:
            self.router = context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            port = self.router.bind_to_random_port(f"tcp://{host}")
        else:
            port = free_port(host)
        self.peer_id = f"{host}:{port}"
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IDENTITY, identity or self.peer_id.encode())
        host, _, target_port = target.rpartition(":")
        self.dealer.connect(f"tcp://{host}:{target_port}")
        self.boot_id = os.urandom(16)
        self.received: list[Message | UnknownMessage] = []

    def hello(
        self,
        *,
        block_len: int = BLOCK_LEN,
        num_blocks: int = 64,
        hash_seed: str = HASH_SEED,
        data_port: int | None = None,
    ) -> Connect:
        """A well-formed ``connect`` offering the tcp plane at ``data_port``."""
        return Connect(
            peer_id=self.peer_id,
            agent_metadata=b"",
            base_addr=0,
            num_blocks=num_blocks,
            block_len=block_len,
            hash_seed=hash_seed,
            config_fingerprint="",
            kvpeer=ConnectExtension(
                version=PROTOCOL_VERSION,
                boot_id=self.boot_id,
                transports={"tcp": {"host": "127.0.0.1", "port": data_port or free_port()}},
            ),
        )

    def ack(self) -> ConnectAck:
        """Our ``connect_ack`` of the node's connect: we "write into it" over tcp."""
        choice = TransportChoice(name="tcp", params={"token": uuid.uuid4().hex})
        return ConnectAck(
            peer_id=self.peer_id, kvpeer=AckExtension(version=PROTOCOL_VERSION, transport=choice)
        )

    def send(self, message: Message) -> None:
        self.send_raw(self.codec.encode(message))

    def send_raw(self, *frames: bytes) -> None:
        self.dealer.send_multipart(list(frames))

    def drain(self) -> None:
        """Record every frame the node has sent us so far."""
        if self.router is None:
            return
        while True:
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) == 2:
                self.received.append(self.codec.decode(parts[1]))

    def wait_for(self, kind: type[M], timeout_s: float = DEADLINE_S) -> M | None:
        """The first message of type ``kind`` the node sent us, waiting up to ``timeout_s``."""
        assert self.router is not None, "a peer without a ROUTER hears nothing"
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            for message in self.received:
                if isinstance(message, kind):
                    return message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.router.poll(int(min(remaining, 0.05) * 1000))

    def close(self) -> None:
        self.dealer.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


class SilentListener:
    """A plain TCP listener that accepts connections and never sends a byte."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.05)
        self.port: int = self._listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="test-silent", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.held.append(self._listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
        self._listener.close()
        for conn in self.held:
            conn.close()


# -- node processes -----------------------------------------------------------------------


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
            cwd=str(PROCS.parents[2]),
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
    """A PD producer process (this file's ``producer`` program) storing synthetic blocks
    ``0..count-1`` for each of ``kv_request_ids`` in ``batches``, ``interval_s`` apart,
    after ``delay_s``; returns once it listens (with ``wait``), inside network
    namespace ``netns`` if given."""
    name = f"producer-{uuid.uuid4().hex[:8]}"
    shm_path = unique_shm_path("producer") if plane == "shm" else ""
    command = [
        sys.executable,
        str(PROCS),
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


# -- the producer program -----------------------------------------------------------------


def _batches(indexes: list[int], batches: int) -> list[list[int]]:
    size = max(1, -(-len(indexes) // max(1, batches)))
    return [indexes[i : i + size] for i in range(0, len(indexes), size)]


def _producer_main(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())

    def watch_stdin() -> None:
        sys.stdin.buffer.read()
        stop.set()

    threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    mapping: dict[str, object] = {}
    if args.config:
        mapping.update(json.loads(Path(args.config).read_text()))
    config = tier_config(args.plane.split(","), args.host, args.port, **mapping)
    pool = BlockPool(max(args.count, 1), args.block_len, shm_path=args.shm_path or None)
    try:
        region = PrimaryRegion(pool.view, pool.num_blocks, pool.block_len, pool.shm_path)
        node = open_node(config, region)
        host = TieringHost(pool, [node])
        print(f"peer {node.tier.peer_id}", flush=True)

        def step_for(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while not stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                node.wait_for_work(min(0.02, remaining))
                host.step()

        contexts = [
            RequestContext(
                f"prefill-{kv_request_id}", {"remote_decoder": {"kv_request_id": kv_request_id}}
            )
            for kv_request_id in args.kv_request_id
        ]
        for context in contexts:
            host.new_request(context)
        host.step()
        step_for(args.delay)
        for number, batch in enumerate(_batches(list(range(args.count)), args.batches)):
            if number:
                step_for(args.interval)
            if stop.is_set():
                break
            blocks = [synthetic_block(i, args.block_len) for i in batch]
            for context in contexts:  # the second request finds them resident: warm producer
                host.store(context, keys_of(batch), blocks)
            host.step()
            print(f"stored batch {number}", flush=True)
        for context in contexts:
            host.finish_request(context)
        host.step()
        print("stored all", flush=True)
        while not stop.is_set():
            node.wait_for_work(0.05)
            host.step()
        host.shutdown()
        print("stopped", flush=True)
    finally:
        pool.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="procs.py")
    commands = parser.add_subparsers(dest="command", required=True)
    producer = commands.add_parser("producer", help="a PD producer of synthetic blocks")
    producer.add_argument("--kv-request-id", action="append", required=True)
    producer.add_argument("--count", type=int, required=True)
    producer.add_argument("--plane", default="tcp")
    producer.add_argument("--block-len", type=int, default=BLOCK_LEN)
    producer.add_argument("--batches", type=int, default=1)
    producer.add_argument("--interval", type=float, default=0.0)
    producer.add_argument("--delay", type=float, default=0.0)
    producer.add_argument("--host", default="127.0.0.1")
    producer.add_argument("--port", type=int, default=0)
    producer.add_argument("--shm-path", default="")
    producer.add_argument("--config")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return _producer_main(args)


if __name__ == "__main__":
    sys.exit(main())
