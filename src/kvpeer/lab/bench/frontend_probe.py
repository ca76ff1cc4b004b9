"""What the front end costs on this machine, measured on an arm's live engines
(``kvpeer bench trace --probe``): CPU seconds of each engine's scheduler process and
API server, the router and the sender per request and per output token, and how an
engine's prefill slows while the other engine and the front end share the cores.

Rules:

1. CPU is read from ``/proc`` before and after a burst, by role, in the processes of
   each engine's group (the ``vllm serve`` server's pid): its *worker* (the process
   named ``VLLM::Worker``: the model's compute), its *core* (``VLLM::EngineCore``:
   the scheduler), its *server* (every other process: the API server); then the
   *router* (this process's threads named ``kvpeer-router``, ``BackgroundRouter``)
   and the *sender* (the rest of this process: vLLM's request function, aiohttp).
2. A burst is ``BURST`` fresh prompts of ``PROMPT`` tokens sent at once through the
   router (it places them), as the trace's bursts are. It runs with 1 and with
   ``1 + TOKENS`` output tokens; per request is the 1-token burst's CPU over its
   requests, per output token the difference of the two over the extra tokens. Each is
   the median of ``rounds`` bursts. The front end's cost is everything but the
   workers: each engine's core (its scheduler, a process of its own that polls its
   worker while it computes), server, the router and the sender, summed: what shares
   the cores with the engines' compute.
3. ``streaming_prefill_ttft_s``: engine ``a`` prefills one fresh prompt of the longest
   probe length (sent straight to it) while ``STREAMS`` requests of a short prompt and
   ``STREAM_TOKENS`` output tokens, pinned to ``b`` through the router, decode and
   stream: the other engine and the whole front end busy at once. Beside the probe's
   ``prefill_ttft_s`` of the same length (alone) and ``pair_prefill_ttft_s`` (both
   engines prefilling, the front end nearly idle) it says what the front end adds.
   The streams start ``STREAM_LEAD_S`` before the prefill and outlast it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kvpeer.lab.bench.serve_client import run_phase
from kvpeer.lab.bench.serve_stats import RequestRecord
from kvpeer.lab.bench.serve_workloads import BenchRequest
from kvpeer.lab.engines.procs import PROC, group_pids

__all__ = ["CpuByRole", "FrontendArm", "cpu_by_role", "probe_frontend"]

BURST = 8
PROMPT = 512
TOKENS = 32
STREAMS = 4  # the engines' --max-num-seqs
STREAM_TOKENS = 400
STREAM_LEAD_S = 1.0
ROUTER_THREAD = "kvpeer-router"
ROLES = ("worker", "core", "server", "router", "sender")

CpuByRole = dict[str, float]


class FrontendArm(Protocol):
    engine_urls: list[str]
    engine_groups: list[int]

    @property
    def urls(self) -> Mapping[str, str]: ...


def _ticks(stat: str) -> int:
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def _engine_role(pid: int) -> str:
    """Rule 1's role of one process of an engine's group."""
    with contextlib.suppress(OSError):
        name = (PROC / str(pid) / "cmdline").read_bytes() + (PROC / str(pid) / "comm").read_bytes()
        if b"VLLM::Worker" in name:
            return "worker"
        if b"EngineCore" in name or b"VLLM::EngineCor" in name:
            return "core"
    return "server"


def cpu_by_role(engine_groups: Sequence[int]) -> CpuByRole:
    """Rule 1: CPU seconds so far of each role (cores and servers summed over engines)."""
    hz = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(ROLES, 0.0)
    for pgid in engine_groups:
        for pid in group_pids(pgid):
            with contextlib.suppress(OSError, ValueError):
                ticks = _ticks((PROC / str(pid) / "stat").read_text())
                out[_engine_role(pid)] += ticks / hz
    router = {t.native_id for t in threading.enumerate()
              if t.name == ROUTER_THREAD and t.native_id is not None}  # fmt: skip
    for tid in router:
        with contextlib.suppress(OSError, ValueError):
            out["router"] += _ticks((PROC / "self" / "task" / str(tid) / "stat").read_text()) / hz
    out["sender"] = time.process_time() - out["router"]
    return out


def _checked(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    for record in records:
        if record.error is not None:
            raise RuntimeError(f"front-end probe request failed: {record.error}")
    return list(records)


def _burst(arm: FrontendArm, fresh: Callable[[int], tuple[int, ...]], outputs: int
           ) -> tuple[CpuByRole, float]:  # fmt: skip
    """Rule 2: one burst; CPU by role used over it, and its wall time."""
    requests = [BenchRequest(0.0, fresh(PROMPT), outputs) for _ in range(BURST)]
    before, started = cpu_by_role(arm.engine_groups), time.monotonic()
    _checked(asyncio.run(run_phase(requests, arm.urls, sender="vllm")))
    wall = time.monotonic() - started
    after = cpu_by_role(arm.engine_groups)
    return {role: after[role] - before[role] for role in ROLES}, wall


def _streaming_prefill(arm: FrontendArm, fresh: Callable[[int], tuple[int, ...]],
                       longest: int) -> tuple[float, CpuByRole, float]:  # fmt: skip
    """Rule 3: ``a``'s prefill TTFT beside ``b`` streaming; CPU by role and wall time."""
    streams = [BenchRequest(0.0, fresh(64), STREAM_TOKENS + 1, pin="b")
               for _ in range(STREAMS)]  # fmt: skip

    async def both() -> tuple[list[RequestRecord], list[RequestRecord]]:
        busy = asyncio.ensure_future(run_phase(streams, arm.urls, sender="vllm"))
        await asyncio.sleep(STREAM_LEAD_S)
        measured = await run_phase([BenchRequest(0.0, fresh(longest), 1)],
                                   {"shared": arm.engine_urls[0]}, sender="vllm")
        return measured, await busy

    before, started = cpu_by_role(arm.engine_groups), time.monotonic()
    measured, streamed = asyncio.run(both())
    wall = time.monotonic() - started
    after = cpu_by_role(arm.engine_groups)
    _checked(measured + streamed)
    if min(r.done_s for r in streamed) < measured[0].sent_s + measured[0].ttft_s:
        raise RuntimeError("front-end probe: the streams ended before the prefill did")
    return measured[0].ttft_s, {role: after[role] - before[role] for role in ROLES}, wall


def probe_frontend(arm: FrontendArm, fresh: Callable[[int], tuple[int, ...]], *,
                   longest: int, rounds: int) -> dict[str, Any]:  # fmt: skip
    """Rules 1-3: CPU seconds per request and per output token by role, the front end's
    (server + router + sender), and ``a``'s prefill of ``longest`` beside a stream."""
    per_request: dict[str, list[float]] = {role: [] for role in ROLES}
    per_token: dict[str, list[float]] = {role: [] for role in ROLES}
    walls: dict[str, list[float]] = {"1": [], str(1 + TOKENS): []}
    for _ in range(rounds):
        short, short_wall = _burst(arm, fresh, 1)
        long, long_wall = _burst(arm, fresh, 1 + TOKENS)
        walls["1"].append(short_wall)
        walls[str(1 + TOKENS)].append(long_wall)
        for role in ROLES:
            per_request[role].append(short[role] / BURST)
            per_token[role].append((long[role] - short[role]) / (BURST * TOKENS))
    streaming: list[float] = []
    stream_cpu: dict[str, list[float]] = {role: [] for role in ROLES}
    for _ in range(rounds):
        ttft, cpu, wall = _streaming_prefill(arm, fresh, longest)
        streaming.append(ttft)
        for role in ROLES:
            stream_cpu[role].append(cpu[role] / wall)
    request = {role: statistics.median(v) for role, v in per_request.items()}
    token = {role: statistics.median(v) for role, v in per_token.items()}
    front = ("core", "server", "router", "sender")
    return {
        "cpu_s_per_request": request,
        "cpu_s_per_output_token": token,
        "frontend_cpu_s_per_request": sum(request[r] for r in front),
        "frontend_cpu_s_per_output_token": sum(token[r] for r in front),
        "burst": {"requests": BURST, "prompt_tokens": PROMPT, "output_tokens": [1, 1 + TOKENS],
                  "wall_s": {k: statistics.median(v) for k, v in walls.items()}},
        "streaming_prefill_ttft_s": {str(longest): statistics.median(streaming)},
        "streaming_cores_by_role": {role: statistics.median(v) for role, v in stream_cpu.items()},
        "streams": {"requests": STREAMS, "output_tokens": STREAM_TOKENS + 1},
        "cores": os.cpu_count(),
    }
