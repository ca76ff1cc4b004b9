"""One host's cores shared by its engines and their front end (API servers, router,
sender): processor sharing, for a fleet whose engines run on CPUs (``cpu-pair``).

A GPU engine computes on its own device and its front end runs on cores it does not
use, so a GPU preset has ``host_cores`` 0 and none of this applies. On this machine two
one-thread engines, both API servers, the router and the sender share two cores.

Rules:

1. What runs: every engine with a step under way is one thread at full speed (its
   worker) and ``scheduler_cores`` more (vLLM's engine-core process, which schedules
   and waits on its worker in a process of its own); every front-end stage in service
   (a request's CPU in the front end before its engine queues it, :class:`FrontEnd`)
   is one more; every output token streamed costs the front end
   ``frontend_s_per_token`` CPU seconds, so an engine decoding ``d`` sequences in steps
   of ``s`` seconds of its own work, stretched by ``k``, adds ``d x g / (s k)`` cores.
2. With ``B`` threads (counted as rule 1 says) and ``S`` = the sum of ``d x g / s``
   over stepping engines, on ``N`` cores every thread gets ``1 / k`` of a core where
   ``k = max(1, (B + S / k) / N)``: ``k = (B + sqrt(B^2 + 4 N S)) / (2 N)`` when that
   exceeds 1, else 1.
3. An engine's step is stretched by ``k``, and by ``co_run_slowdown`` more while
   another engine of the host has a step under way (what two engines cost each other
   beyond sharing cores: memory, caches; the pair probe says how much). ``k`` is
   recomputed whenever a step or a stage starts or ends, and every step under way is
   re-rated from then on (its remaining work at the new speed); a front-end stage takes
   ``frontend_s_per_request x k`` with the ``k`` of its start.
4. A front-end stage is served one at a time per engine, first come first served (each
   engine's API server is one Python thread); the request joins its engine's queue when
   its stage ends.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["CpuUser", "FrontEnd", "HostCpu", "sharing_factor"]


def sharing_factor(threads: float, streaming: float, cores: int) -> float:
    """Rule 2: how much slower each runnable thread goes (at least 1)."""
    if cores <= 0:
        return 1.0
    k = (threads + math.sqrt(threads * threads + 4.0 * cores * streaming)) / (2.0 * cores)
    return max(1.0, k)


class CpuUser(Protocol):
    """An engine as the host's cores see it."""

    @property
    def stepping(self) -> bool: ...

    @property
    def stream_rate(self) -> float:
        """Tokens per second of its own work in the step under way (decodes / step)."""
        ...

    def rerate(self, now: float, factor: float) -> None: ...


class HostCpu:
    """Rules 1-3 for the engines attached to one host."""

    def __init__(self, cores: int, token_cpu_s: float, co_run_slowdown: float = 1.0,
                 scheduler_cores: float = 0.0) -> None:  # fmt: skip
        self.cores = cores
        self._token_cpu_s = token_cpu_s
        self._co_run = co_run_slowdown
        self._scheduler = scheduler_cores
        self._engines: list[CpuUser] = []
        self._stages = 0
        self.factor = 1.0

    def attach(self, engine: CpuUser) -> None:
        self._engines.append(engine)

    def stage(self, delta: int, now: float) -> None:
        """A front-end stage started (+1) or ended (-1)."""
        self._stages += delta
        self.changed(now)

    def changed(self, now: float) -> None:
        """Something started or ended a step: re-rate every engine (rule 3)."""
        stepping = [e for e in self._engines if e.stepping]
        streaming = sum(e.stream_rate for e in stepping) * self._token_cpu_s
        threads = len(stepping) * (1.0 + self._scheduler) + self._stages
        self.factor = sharing_factor(threads, streaming, self.cores)
        pair = len(stepping) >= 2
        for engine in self._engines:
            others = len(stepping) - (1 if engine.stepping else 0)
            engine.rerate(now, self.factor * (self._co_run if pair and others else 1.0))


class FrontEnd:
    """Rule 4: one engine's front end, a queue of requests each taking its CPU."""

    def __init__(self, cpu: HostCpu, cpu_s: float,
                 schedule: Callable[[float, Callable[[float], None]], None]) -> None:
        self._cpu = cpu
        self._cpu_s = cpu_s
        self._schedule = schedule
        self._queue: deque[Callable[[float], None]] = deque()
        self._busy = False

    def submit(self, done: Callable[[float], None], now: float) -> None:
        """``done(t)`` when this request's stage ends."""
        self._queue.append(done)
        if not self._busy:
            self._next(now)

    def _next(self, now: float) -> None:
        if not self._queue:
            self._busy = False
            return
        self._busy = True
        done = self._queue.popleft()
        self._cpu.stage(+1, now)
        took = self._cpu_s * self._cpu.factor

        def end(t: float) -> None:
            self._cpu.stage(-1, t)
            done(t)
            self._next(t)

        self._schedule(now + took, end)
