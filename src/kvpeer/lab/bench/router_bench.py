"""``kvpeer bench router``: what the router costs a request, against the same backend direct.

A fake engine (``kvpeer.lab.engines.fakeengine``) runs in one process and ``kvpeer router`` in
another; this process is the client. Each repeat measures, back to back and in
alternating order (so drift on a shared machine hits both sides alike):

- latency: ``requests`` requests one after another, direct to the fake and through the
  router; added latency = router percentile - direct percentile of that repeat;
- throughput: ``requests`` requests at ``concurrency``, direct and through the router
  (requests/s), plus the router process's own CPU seconds over the routed run, which
  gives its capacity per core (requests / CPU-second) even when the client or the fake,
  not the router, is what saturates.

The router process is pinned to one CPU and the fake plus this client to the others
when the machine has two or more, so "per core" means one core. Reported numbers are
medians over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RepeatResult", "RouterBenchSpec", "add_arguments", "percentile", "render", "run",
           "summarize"]

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class RouterBenchSpec:
    requests: int = 2000
    concurrency: int = 32
    repeats: int = 3
    stream: bool = False
    prompt_tokens: int = 256
    max_tokens: int = 4

    def __post_init__(self) -> None:
        for key in ("requests", "concurrency", "repeats", "prompt_tokens", "max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1, got {getattr(self, key)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterBenchSpec:
        base = cls(requests=300, repeats=3) if args.quick else cls()
        return cls(
            requests=args.requests or base.requests,
            concurrency=args.concurrency or base.concurrency,
            repeats=args.repeats or base.repeats,
            stream=args.stream,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, help="requests per measurement (default 2000)")
    parser.add_argument("--concurrency", type=int, help="concurrent requests (default 32)")
    parser.add_argument("--repeats", type=int, help="repeats; medians reported (default 3)")
    parser.add_argument("--stream", action="store_true", help="streamed requests (SSE)")
    parser.add_argument("--quick", action="store_true", help="300 requests per measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True, slots=True)
class RepeatResult:
    direct_latencies: Sequence[float]
    router_latencies: Sequence[float]
    direct_rps: float
    router_rps: float
    router_cpu_s: float  # the router process's CPU over its concurrent run
    routed_requests: int


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(repeats: Sequence[RepeatResult]) -> dict[str, float]:
    """Medians over repeats; latencies in milliseconds."""

    def med(values: Sequence[float]) -> float:
        return statistics.median(values)

    out: dict[str, float] = {}
    for q in (50, 99):
        direct = [percentile(r.direct_latencies, q) * 1e3 for r in repeats]
        routed = [percentile(r.router_latencies, q) * 1e3 for r in repeats]
        out[f"direct_p{q}_ms"] = med(direct)
        out[f"router_p{q}_ms"] = med(routed)
        out[f"added_p{q}_ms"] = med([b - a for a, b in zip(direct, routed, strict=True)])
    out["direct_rps"] = med([r.direct_rps for r in repeats])
    out["router_rps"] = med([r.router_rps for r in repeats])
    out["router_capacity_rps_per_core"] = med(
        [r.routed_requests / r.router_cpu_s for r in repeats if r.router_cpu_s > 0] or [0.0]
    )
    return out


def render(result: dict[str, Any]) -> str:
    s = result["summary"]
    spec = result["spec"]
    return "\n".join([
        f"kvpeer bench router: {spec['requests']} requests x {spec['repeats']} repeats, "
        f"{'streamed' if spec['stream'] else 'non-streamed'}, prompt {spec['prompt_tokens']} "
        f"token ids, concurrency {spec['concurrency']} (medians over repeats)",
        f"{'':28}{'direct':>12}{'via router':>12}{'added':>12}",
        f"{'latency p50 (ms)':28}{s['direct_p50_ms']:12.3f}{s['router_p50_ms']:12.3f}"
        f"{s['added_p50_ms']:12.3f}",
        f"{'latency p99 (ms)':28}{s['direct_p99_ms']:12.3f}{s['router_p99_ms']:12.3f}"
        f"{s['added_p99_ms']:12.3f}",
        f"{'throughput (requests/s)':28}{s['direct_rps']:12.0f}{s['router_rps']:12.0f}",
        f"router CPU: {s['router_capacity_rps_per_core']:.0f} requests per CPU-second "
        f"(router pinned to CPU {result['router_cpu']})",
    ])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_ready(path: Path, process: subprocess.Popen[bytes], what: str) -> str:
    """Wait for a child's ready file (bounded), failing at once if the child dies."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not path.exists():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.02)  # another process; nothing to wait on but its file
    return path.read_text().strip()


def _spawn(args: list[str], cpus: set[int] | None) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, *args], start_new_session=True,
        stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    if cpus:
        os.sched_setaffinity(process.pid, cpus)
    return process


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def _one(session: Any, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    async with session.post(url, json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}")
    return time.perf_counter() - started


async def _sequential(session: Any, url: str, body: dict[str, Any], n: int) -> list[float]:
    return [await _one(session, url, body) for _ in range(n)]


async def _concurrent(session: Any, url: str, body: dict[str, Any], n: int, c: int) -> float:
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await _one(session, url, body)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    return n / (time.perf_counter() - started)


async def _measure(spec: RouterBenchSpec, direct: str, routed: str, router_pid: int,
                   progress: Callable[[str], None]) -> list[RepeatResult]:
    import aiohttp

    body: dict[str, Any] = {"model": "fake-model", "prompt": list(range(spec.prompt_tokens)),
                            "max_tokens": spec.max_tokens, "stream": spec.stream}
    connector = aiohttp.TCPConnector(limit=spec.concurrency)
    results = []
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in (direct, routed):  # warm connections and code paths
            await _concurrent(session, url, body, max(50, spec.concurrency), spec.concurrency)
        for repeat in range(spec.repeats):
            order = (direct, routed) if repeat % 2 == 0 else (routed, direct)
            latencies = {url: await _sequential(session, url, body, spec.requests)
                         for url in order}
            rps: dict[str, float] = {}
            cpu = 0.0
            for url in order:
                before = _cpu_seconds(router_pid)
                rps[url] = await _concurrent(session, url, body, spec.requests,
                                             spec.concurrency)
                if url == routed:
                    cpu = _cpu_seconds(router_pid) - before
            results.append(RepeatResult(latencies[direct], latencies[routed], rps[direct],
                                        rps[routed], cpu, spec.requests))
            progress(f"repeat {repeat + 1}/{spec.repeats}: p50 direct "
                     f"{percentile(latencies[direct], 50) * 1e3:.3f} ms, via router "
                     f"{percentile(latencies[routed], 50) * 1e3:.3f} ms; "
                     f"{rps[direct]:.0f} vs {rps[routed]:.0f} requests/s")
    return results


def run(spec: RouterBenchSpec, progress: Callable[[str], None]) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    router_cpus = {cpus[-1]} if len(cpus) > 1 else None
    others = set(cpus[:-1]) if len(cpus) > 1 else None
    if others:
        os.sched_setaffinity(0, others)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvpeer-bench-router-") as tmp:
            ready = Path(tmp)
            fake = _spawn(["-m", "kvpeer.lab.engines.fakeengine", "--no-record", "--chunks",
                           str(spec.max_tokens), "--ready-file", str(ready / "fake")], others)
            processes.append(fake)
            fake_url = _wait_ready(ready / "fake", fake, "fake engine")
            router = _spawn(["-m", "kvpeer.cli", "--log-level", "ERROR", "router", "--mode",
                             "shared", "--listen",
                             "127.0.0.1:0", "--engine", f"e0={fake_url},peer=127.0.0.1:5710",
                             "--health-interval", "30", "--no-tokenize",
                             "--ready-file", str(ready / "router")], router_cpus)
            processes.append(router)
            router_url = _wait_ready(ready / "router", router, "kvpeer router")
            progress(f"fake engine {fake_url}, router {router_url}; measuring")
            path = "/v1/completions"
            repeats = asyncio.run(_measure(spec, fake_url + path, router_url + path,
                                           router.pid, progress))
    finally:
        for process in reversed(processes):
            _kill(process)
        if others:
            os.sched_setaffinity(0, set(cpus))
    return {
        "spec": {"requests": spec.requests, "concurrency": spec.concurrency,
                 "repeats": spec.repeats, "stream": spec.stream,
                 "prompt_tokens": spec.prompt_tokens},
        "router_cpu": sorted(router_cpus)[0] if router_cpus else None,
        "summary": summarize(repeats),
    }
