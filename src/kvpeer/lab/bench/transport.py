"""``kvpeer bench transport``: kvpeer's data planes against raw baselines, same run.

A producer node runs as a separate process (``kvpeer serve --synthetic-blocks``);
the consumer node runs here and pulls synthetic blocks with real lookups and
fetches. For each data plane, block size and fetch size the load time (fetch ->
data -> ``transfer_done``) gives GB/s, printed next to the baseline measured in
this run on the same number of bytes:

- ``tcp`` against a raw loopback socket between two processes,
- ``shm`` against a single-thread memcpy between page-aligned buffers,
- ``nixl`` against a raw NIXL agent-to-agent WRITE (when nixl is installed).

The one-block fetch is also reported as a round trip (``rtt_us``) next to a raw
ZMQ DEALER/ROUTER ping-pong (``zmq_rtt_us``). Medians of several repetitions;
the machine is shared and noisy, so compare ratios, not absolute numbers.

With ``--metrics`` both nodes serve ``/metrics`` and the one-block round trip is
also measured while a thread scrapes both over HTTP at ``SCRAPE_HZ`` (metrics
on), in rounds interleaved with unscraped ones (off): ``rtt_us_metrics``.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpeer.config import TierConfig
from kvpeer.host import BlockPool
from kvpeer.lab.bench.rawnixl import raw_nixl_gbps
from kvpeer.lab.bench.tier_bench import SCRAPE_HZ, scraping
from kvpeer.lab.engines.launcher import free_port
from kvpeer.lab.pull import Puller
from kvpeer.node.build import open_node
from kvpeer.node.driver import DrivenTier
from kvpeer.node.synthetic import synthetic_index, synthetic_key
from kvpeer.transport.data.base import PrimaryRegion

__all__ = ["BenchSpec", "render", "run"]

#: Both nodes of the benchmark are on this machine: trust each other's NIXL metadata.
LOOPBACK = "127.0.0.0/8"

KIB = 1024
MIB = 1024 * KIB
MAX_REGION_BYTES = 1024 * MIB  # per side
RTT_REPS = 51  # one-block fetches per median
#: Serves a node's metrics on a free loopback port: (port, close).
ServeMetrics = Callable[[DrivenTier], tuple[int, Callable[[], None]]]


@dataclass(frozen=True, slots=True)
class BenchSpec:
    planes: tuple[str, ...]
    block_lens: tuple[int, ...]
    fetch_sizes: tuple[int, ...]
    reps: int

    @classmethod
    def full(cls, planes: tuple[str, ...]) -> BenchSpec:
        return cls(planes, (64 * KIB, 256 * KIB, MIB, 4 * MIB), (1, 16, 256, 1024), 5)

    @classmethod
    def quick(cls, planes: tuple[str, ...]) -> BenchSpec:
        return cls(planes, (64 * KIB, MIB), (1, 64), 3)


# -- baselines ---------------------------------------------------------------------------


def memcpy_gbps(total: int, reps: int) -> float:
    """Single-thread memcpy between page-aligned, prefaulted buffers."""
    src, dst = mmap.mmap(-1, total), mmap.mmap(-1, total)
    s, d = memoryview(src), memoryview(dst)
    s[:] = b"\x01" * total  # prefault both
    d[:] = s
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        d[:] = s
        samples.append(time.perf_counter() - start)
    s.release()
    d.release()
    src.close()
    dst.close()
    return total / statistics.median(samples) / 1e9


def _baseline_child(sock_port: int, zmq_port: int, max_bytes: int) -> None:
    """Child process: receive sized payloads on a socket; echo on a ZMQ ROUTER."""
    import threading

    import zmq

    def zmq_echo() -> None:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.connect(f"tcp://127.0.0.1:{zmq_port}")
        while True:
            frames = router.recv_multipart()
            if frames[-1] == b"stop":
                break
            router.send_multipart(frames)
        ctx.destroy(linger=0)

    echo = threading.Thread(target=zmq_echo, daemon=True)
    echo.start()
    buffer = mmap.mmap(-1, max_bytes)
    view = memoryview(buffer)
    view[::4096] = bytes(len(range(0, max_bytes, 4096)))
    conn = socket.create_connection(("127.0.0.1", sock_port))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MIB)
    header = bytearray(8)
    while True:
        if conn.recv_into(header, 8, socket.MSG_WAITALL) != 8:
            break
        (size,) = struct.unpack("<Q", header)
        if size == 0:
            break
        got = 0
        while got < size:
            n = conn.recv_into(view[got:size])
            if n == 0:
                return
            got += n
        conn.sendall(b"k")
    echo.join(timeout=5)


class Baselines:
    """A child process for the raw socket and ZMQ round-trip baselines."""

    def __init__(self, max_bytes: int) -> None:
        import zmq

        self._listener = socket.create_server(("127.0.0.1", 0))
        self._zmq = zmq.Context()
        self._dealer = self._zmq.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        zmq_port = self._dealer.bind_to_random_port("tcp://127.0.0.1")
        context = multiprocessing.get_context("spawn")
        self._child = context.Process(
            target=_baseline_child,
            args=(self._listener.getsockname()[1], zmq_port, max_bytes),
            daemon=True,
        )
        self._child.start()
        self._conn, _ = self._listener.accept()
        self._conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MIB)
        payload = mmap.mmap(-1, max_bytes)
        self._payload = memoryview(payload)
        self._payload[:] = b"\x02" * max_bytes
        self._mmap = payload

    def socket_gbps(self, total: int, reps: int) -> float:
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            self._conn.sendall(struct.pack("<Q", total))
            self._conn.sendall(self._payload[:total])
            if self._conn.recv(1) != b"k":
                raise RuntimeError("baseline child went away")
            samples.append(time.perf_counter() - start)
        return total / statistics.median(samples) / 1e9

    def zmq_rtt_us(self, rounds: int = 300) -> float:
        samples = []
        message = b"x" * 64
        for _ in range(20):  # warm up the connection
            self._dealer.send(message)
            self._dealer.recv()
        for _ in range(rounds):
            start = time.perf_counter()
            self._dealer.send(message)
            self._dealer.recv()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.sendall(struct.pack("<Q", 0))
        with contextlib.suppress(Exception):
            self._dealer.send(b"stop")
        self._child.join(timeout=5)
        if self._child.is_alive():
            self._child.kill()
        self._conn.close()
        self._listener.close()
        self._zmq.destroy(linger=0)
        self._payload.release()
        self._mmap.close()


# -- kvpeer ------------------------------------------------------------------------------


@contextlib.contextmanager
def producer(
    plane: str, block_len: int, blocks: int, metrics_port: int | None = None
) -> Iterator[str]:
    """A ``kvpeer serve`` process with ``blocks`` synthetic blocks; yields its peer id."""
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        command = [
            sys.executable, "-m", "kvpeer", "serve", "--host", "127.0.0.1", "--port", "0",
            "--data-planes", plane, "--block-len", str(block_len), "--blocks", str(blocks),
            "--synthetic-blocks", str(blocks), "--ready-file", str(ready),
            "--nixl-peer", LOOPBACK,
        ]  # fmt: skip
        if metrics_port is not None:
            command += ["--metrics-port", str(metrics_port)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    error = process.stderr.read().decode() if process.stderr else ""
                    raise RuntimeError(f"kvpeer serve ({plane}) did not start: {error[-800:]}")
                time.sleep(0.05)
            yield ready.read_text()
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _consumer(plane: str, block_len: int, blocks: int) -> tuple[Any, BlockPool]:
    shm_path = f"/dev/shm/kvpeer-bench-{os.getpid()}-{block_len}" if plane == "shm" else None
    pool = BlockPool(blocks, block_len, shm_path=shm_path)
    config = TierConfig.from_dict(
        {"host": "127.0.0.1", "port": 0, "data_transports": [plane],
         "hash_seed": "vllm-none-hash", "nixl_peers": [LOOPBACK]}
    )  # fmt: skip
    region = PrimaryRegion(pool.view, blocks, block_len, pool.shm_path)
    return open_node(config, region), pool


def _get(url: str) -> None:
    with urllib.request.urlopen(url, timeout=10) as response:
        response.read()


def measure_plane(
    plane: str,
    block_len: int,
    fetch_sizes: tuple[int, ...],
    reps: int,
    serve_metrics: ServeMetrics | None = None,
    scraped: dict[str, float] | None = None,
) -> dict[int, tuple[float, float]]:
    """fetch size -> (median load seconds, median lookup seconds). One-block fetches
    are repeated :data:`RTT_REPS` times at least: they are quick, and noisy. With
    ``serve_metrics``, ``scraped`` receives :func:`_scraped_rtt`'s numbers."""
    blocks = max(fetch_sizes)
    results: dict[int, tuple[float, float]] = {}
    producer_port = free_port() if serve_metrics is not None else None
    with producer(plane, block_len, blocks, producer_port) as peer_id:
        node, pool = _consumer(plane, block_len, blocks)
        close_metrics: Callable[[], None] | None = None
        try:
            urls = []
            if serve_metrics is not None:
                port, close_metrics = serve_metrics(node)
                urls = [f"http://127.0.0.1:{p}/metrics" for p in (port, producer_port)]
            puller = Puller(node, peer_id)
            keys = [synthetic_key(i) for i in range(blocks)]
            slots = list(range(blocks))
            # Handshake, then one pull of every block: the producer's mapping of our
            # region is faulted in (steady state: a new peer's first writes are
            # slower until its prefault is done, see the shm plane).
            puller.pull(keys[:1], slots[:1])
            puller.pull(keys, slots)
            for size in fetch_sizes:
                loads, lookups = [], []
                for _ in range(max(reps, RTT_REPS) if size == 1 else reps):
                    result = puller.pull(keys[:size], slots[:size])
                    if not result.loaded or result.hits != size:
                        raise RuntimeError(
                            f"{plane}: pull of {size} x {block_len} B failed ({result})"
                        )
                    for slot in (0, size - 1):
                        if (
                            synthetic_index(pool.view[slot * block_len : (slot + 1) * block_len])
                            != slot
                        ):
                            raise RuntimeError(f"{plane}: slot {slot} holds the wrong bytes")
                    loads.append(result.load_s)
                    lookups.append(result.lookup_s)
                results[size] = (statistics.median(loads), statistics.median(lookups))
            if urls and scraped is not None:
                scraped.update(_scraped_rtt(puller, keys, slots, urls))
        finally:
            if close_metrics is not None:
                close_metrics()
            node.shutdown()
            pool.close()
    return results


def _scraped_rtt(
    puller: Puller, keys: list[bytes], slots: list[int], urls: list[str]
) -> dict[str, float]:
    """One-block load seconds, median, with ``urls`` scraped (``on_s``) and not
    (``off_s``), in 3 interleaved pairs of rounds; scrapes per second while on."""
    on: list[float] = []
    off: list[float] = []
    scrapes, seconds = 0, 0.0

    def scrape() -> None:
        for url in urls:
            _get(url)

    for _ in range(3):
        off += [puller.pull(keys[:1], slots[:1]).load_s for _ in range(RTT_REPS)]
        started = time.perf_counter()
        with scraping(scrape, SCRAPE_HZ / len(urls)) as done:
            on += [puller.pull(keys[:1], slots[:1]).load_s for _ in range(RTT_REPS)]
        seconds += time.perf_counter() - started
        scrapes += done[0] * len(urls)
    return {
        "on_s": statistics.median(on),
        "off_s": statistics.median(off),
        "scrapes_per_s": scrapes / seconds,
    }


def run(
    spec: BenchSpec,
    progress: Callable[[str], None],
    serve_metrics: ServeMetrics | None = None,
) -> dict[str, Any]:
    """``serve_metrics``: also measure the one-block rtt with metrics scraped."""
    max_bytes = max(
        min(b, MAX_REGION_BYTES // bl) * bl for bl in spec.block_lens for b in spec.fetch_sizes
    )
    baselines = Baselines(max_bytes)
    cache: dict[tuple[str, int, int], float | None] = {}

    def baseline(kind: str, block_len: int, blocks: int) -> float | None:
        key = (kind, block_len, blocks)
        if key not in cache:
            total = block_len * blocks
            if kind == "memcpy":
                cache[key] = memcpy_gbps(total, spec.reps)
            elif kind == "socket":
                cache[key] = baselines.socket_gbps(total, spec.reps)
            else:
                cache[key] = raw_nixl_gbps(block_len, blocks, spec.reps)
        return cache[key]

    results: list[dict[str, Any]] = []
    zmq_rtts: list[float] = []
    try:
        for plane in spec.planes:
            kind = {"tcp": "socket", "shm": "memcpy", "nixl": "nixl"}[plane]
            for block_len in spec.block_lens:
                sizes = tuple(s for s in spec.fetch_sizes if s * block_len <= MAX_REGION_BYTES)
                # Measured next to each plane's one-block fetches: the machine's
                # noise moves both together.
                zmq_rtt = baselines.zmq_rtt_us()
                zmq_rtts.append(zmq_rtt)
                progress(
                    f"{plane}: {block_len // KIB} KiB blocks, fetches of {sizes} "
                    f"(raw ZMQ round trip now: {zmq_rtt:.0f} us)"
                )
                scraped: dict[str, float] = {}
                timings = measure_plane(plane, block_len, sizes, spec.reps, serve_metrics, scraped)
                for size, (load_s, _lookup_s) in timings.items():
                    total = size * block_len
                    gbps = total / load_s / 1e9
                    base = baseline(kind, block_len, size)
                    row: dict[str, Any] = {
                        "transport": plane,
                        "block_len": block_len,
                        "blocks": size,
                        "gbps": round(gbps, 3),
                        "baseline": {"socket": "raw_socket", "memcpy": "memcpy",
                                     "nixl": "raw_nixl"}[kind],
                        "baseline_gbps": None if base is None else round(base, 3),
                        "ratio": None if not base else round(gbps / base, 3),
                    }  # fmt: skip
                    if size == 1:
                        copy_us = block_len / (baseline("memcpy", block_len, 1) or 1) / 1e3
                        row["rtt_us"] = round(load_s * 1e6, 1)
                        row["zmq_rtt_us"] = round(zmq_rtt, 1)
                        row["rtt_target_us"] = round(3 * zmq_rtt + copy_us, 1)
                        if scraped:
                            row["rtt_us_metrics_off"] = round(scraped["off_s"] * 1e6, 1)
                            row["rtt_us_metrics_on"] = round(scraped["on_s"] * 1e6, 1)
                            row["scrapes_per_s"] = round(scraped["scrapes_per_s"], 1)
                    results.append(row)
    finally:
        baselines.close()
    return {"zmq_rtt_us": round(statistics.median(zmq_rtts), 1), "results": results}


def render(result: dict[str, Any]) -> str:
    lines = [
        f"raw ZMQ DEALER/ROUTER round trip (64 B): {result['zmq_rtt_us']:.0f} us (median; "
        "each row's target uses the one measured next to it)",
        f"{'plane':5} {'block':>7} {'blocks':>6} {'GB/s':>7}  {'baseline':10} {'GB/s':>7} "
        f"{'ratio':>6}  {'1-block rtt us (target)':>24}",
    ]
    for row in result["results"]:
        base = "n/a" if row["baseline_gbps"] is None else f"{row['baseline_gbps']:7.2f}"
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:6.2f}"
        rtt = f"{row['rtt_us']:.0f} ({row['rtt_target_us']:.0f})" if "rtt_us" in row else ""
        lines.append(
            f"{row['transport']:5} {row['block_len'] // KIB:>5}Ki {row['blocks']:>6} "
            f"{row['gbps']:7.2f}  {row['baseline']:10} {base:>7} {ratio:>6}  {rtt:>24}"
        )
    scraped = [row for row in result["results"] if "rtt_us_metrics_on" in row]
    if scraped:
        lines.append("1-block rtt with metrics off vs on (both nodes' /metrics scraped), same run:")
        lines.append(f"  {'plane':5} {'block':>7} {'off us':>8} {'on us':>8} {'on/off':>6} "
                     f"{'scrapes/s':>9}")  # fmt: skip
        for row in scraped:
            off, on = row["rtt_us_metrics_off"], row["rtt_us_metrics_on"]
            lines.append(
                f"  {row['transport']:5} {row['block_len'] // KIB:>5}Ki {off:8.0f} {on:8.0f} "
                f"{on / off:6.2f} {row['scrapes_per_s']:9.0f}"
            )
    return "\n".join(lines)
