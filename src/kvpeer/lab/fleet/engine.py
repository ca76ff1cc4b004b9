"""One simulated GPU engine: vLLM's scheduler at step granularity.

Rules (vLLM V1's scheduler as far as the model needs it):

1. A step decodes one token of every running request, then prefills waiting work in
   arrival order up to ``step_tokens`` tokens in all (chunked prefill), with at most
   ``max_num_seqs`` requests running. Its duration is :meth:`GpuModel.step_s`.
2. A request is admitted (starts prefilling) only if the KV memory of every admitted
   request, prompt and output reserved whole, fits in ``kv_tokens``; the head of the
   queue waits until it does (first come, first served). The GPU prefix cache holds
   full blocks in what admitted requests leave free, least recently used out.
3. When a request reaches the head of the queue its prefix is looked up: the GPU cache,
   then the engine's CPU tier (loaded over PCIe), then whatever the host fetches for it
   (a pull from a peer, or a bound's pool). While that loads the request is parked and
   the queue moves on; a pull adds ``pull_steps`` of this engine's steps after it lands
   (vLLM promotes, then loads; none if the engine is idle).
4. Its first token comes at the end of the step that computes its last prompt token;
   its computed full blocks then enter the GPU cache and the CPU tier (which keeps
   ``cpu_blocks``, LRU) and are announced as KV events; it then decodes
   ``output_length - 1`` more steps and ends.
5. With nothing to prefill, decode-only steps run as one span up to the next request
   that ends; an arrival cuts the span at the end of the step under way.
6. On a host whose cores the engines share (``cpu``, :mod:`~kvpeer.lab.fleet.hostcpu`),
   a span's steps take :meth:`GpuModel.step_s` times the host's current factor, and a
   change of factor re-rates the span under way: its steps still to come, and the rest
   of the one under way, at the new factor.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpeer.lab.fleet.hostcpu import HostCpu
from kvpeer.lab.fleet.lru import BlockLru
from kvpeer.lab.fleet.params import GpuModel
from kvpeer.lab.trace.mooncake import TraceRequest
from kvpeer.router.cost import CONSUMER_PULL_STEPS
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU
from kvpeer.router.kvevents import BlocksRemoved, BlocksStored, KVEvent

__all__ = ["EngineHost", "Fetched", "Job", "SimEngine"]


@dataclass(eq=False, slots=True)
class Job:
    """One request on its engine."""

    rid: str
    request: TraceRequest
    arrival: float
    engine: str = ""
    source: str | None = None  # the peer the router named
    local_blocks: int = 0  # from this engine's GPU cache or CPU tier
    fetched_blocks: int = 0  # pulled from a peer or the bound's pool
    computed: int = 0  # prompt tokens prefilled so far (past the cached ones)
    first_token: float | None = None
    finished: float | None = None
    looked_up: bool = False
    steps_left: int = 0  # engine steps still to wait after its pull landed (rule 3)

    @property
    def prompt(self) -> int:
        return self.request.input_length

    @property
    def cached_tokens(self) -> int:
        return (self.local_blocks + self.fetched_blocks) * self.request.block_tokens

    @property
    def reserve(self) -> int:
        return self.request.input_length + self.request.output_length


@dataclass(frozen=True, slots=True)
class Fetched:
    """What the host found for a request beyond the engine's own caches."""

    blocks: int  # prefix blocks in all after the fetch (at least the local ones)
    ready_at: float
    steps: int = 0  # engine steps to wait once it landed


class EngineHost(Protocol):
    """The world an engine lives in."""

    def schedule(self, at: float, action: Callable[[float], None]) -> None: ...
    def fetch(self, engine: SimEngine, job: Job, local: int, now: float) -> Fetched: ...
    def publish(self, engine: str, events: list[KVEvent]) -> None: ...
    def block_tokens(self, block: int) -> tuple[int, ...]: ...
    def first_token(self, job: Job, now: float) -> None: ...
    def finished(self, job: Job, now: float) -> None: ...


@dataclass(slots=True)
class _Span:
    """The step(s) under way: ``count`` steps of ``each`` seconds from ``start``."""

    start: float
    each: float
    count: int
    chunks: list[tuple[Job, int]] = field(default_factory=list)
    version: int = 0


class SimEngine:
    """Rules 1-5 of the module docstring."""

    def __init__(
        self, name: str, gpu: GpuModel, host: EngineHost, *, block_tokens: int,
        local_caches: bool = True, events: bool = True, cpu: HostCpu | None = None,
    ) -> None:
        self.name = name
        self._gpu = gpu
        self._host = host
        self._bt = block_tokens
        self._local = local_caches
        self._events = events
        self._gpu_blocks = gpu.kv_tokens // block_tokens
        cpu_blocks = int(gpu.cpu_tier_bytes // (gpu.kv_bytes_per_token * block_tokens))
        self.gpu_cache = BlockLru(self._gpu_blocks)
        self.cpu_tier = BlockLru(cpu_blocks)
        self._waiting: deque[Job] = deque()
        self._prefilling: list[Job] = []
        self._landing: list[Job] = []  # pulled, waiting out their steps (rule 3)
        self._decoding: list[tuple[int, int, Job]] = []  # (last step, seq, job) heap
        self._seq = 0
        self._context = 0  # tokens of context over the decoding requests
        self._steps = 0
        self._used = 0  # KV tokens reserved by admitted requests (rule 2)
        self._span: _Span | None = None
        self._version = 0
        self._cpu = cpu
        self._factor = 1.0  # rule 6: the host's stretch of this engine's steps
        self._stream = 0.0  # decodes per second of own work in the span under way
        if cpu is not None:
            cpu.attach(self)
        self.busy_s = 0.0
        self.steps_run = 0

    # --- what the host and the router see -------------------------------------------

    @property
    def running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    def next_window(self, now: float) -> float:
        """When this engine next answers a peer: at the end of the step under way."""
        span = self._span
        if span is None:
            return now
        done = math.floor((now - span.start) / span.each) if span.each > 0 else 0
        return span.start + min(span.count, done + 1) * span.each

    @property
    def stepping(self) -> bool:
        return self._span is not None

    @property
    def stream_rate(self) -> float:
        return self._stream if self._span is not None else 0.0

    def rerate(self, now: float, factor: float) -> None:
        """Rule 6: the span under way goes on at ``factor`` from ``now``."""
        old, self._factor = self._factor, factor
        span = self._span
        if span is None or factor == old:
            return
        r = factor / old
        self._schedule_end(now - (now - span.start) * r, span.each * r, span.count, span.chunks)

    def submit(self, job: Job, now: float) -> None:
        self._waiting.append(job)
        self._kick(now)

    def landed(self, job: Job, now: float) -> None:
        """The job's fetch is in (rule 3): it waits out its steps, then is first in line."""
        if job.steps_left > 0 and self._span is not None:
            self._landing.append(job)
            return
        job.steps_left = 0
        self._waiting.appendleft(job)
        self._kick(now)

    # --- steps ------------------------------------------------------------------------

    def _kick(self, now: float) -> None:
        span = self._span
        if span is None:
            self._start(now)
        elif span.count > 1:  # rule 5: cut the decode-only span after the step under way
            done = math.floor((now - span.start) / span.each)
            count = min(span.count, done + 1)
            if count < span.count:
                self._schedule_end(span.start, span.each, count, span.chunks)

    def _schedule_end(self, start: float, each: float, count: int,
                      chunks: list[tuple[Job, int]]) -> None:  # fmt: skip
        self._version += 1
        span = self._span = _Span(start, each, count, chunks, self._version)
        version = span.version
        self._host.schedule(start + each * count, lambda t: self._end(t, version))

    def _admit(self, now: float) -> None:
        gpu = self._gpu
        while self._waiting and self.running < gpu.max_num_seqs:
            job = self._waiting[0]
            if not job.looked_up:
                job.looked_up = True
                if self._look_up(job, now):
                    self._waiting.popleft()
                    continue  # parked until its prefix is loaded
            if self._used + job.reserve > gpu.kv_tokens and self.running:
                break  # rule 2: the head waits for memory
            self._waiting.popleft()
            self._used += job.reserve
            self.gpu_cache.touch(job.request.full_blocks[: job.local_blocks + job.fetched_blocks])
            free = self._gpu_blocks - -(-self._used // self._bt)
            self._announce_removed(MEDIUM_GPU, self.gpu_cache.shrink(free))
            self._prefilling.append(job)

    def _look_up(self, job: Job, now: float) -> bool:
        """Rule 3; True if the job is parked for a load."""
        blocks = job.request.full_blocks
        usable = max(0, job.prompt - 1) // self._bt
        ready = now
        if self._local:
            on_gpu = self.gpu_cache.prefix(blocks, usable)
            in_cpu = self.cpu_tier.prefix(blocks, usable)
            job.local_blocks = max(on_gpu, in_cpu)
            if in_cpu > on_gpu:
                self.cpu_tier.touch(blocks[:in_cpu])
                ready = now + self._gpu.load_s((in_cpu - on_gpu) * self._bt)
        fetched = self._host.fetch(self, job, job.local_blocks, now)
        if fetched.blocks > job.local_blocks:
            job.fetched_blocks = min(usable, fetched.blocks) - job.local_blocks
            ready = max(ready, fetched.ready_at)
            job.steps_left = fetched.steps
        if ready <= now:
            return False
        self._host.schedule(ready, lambda t: self.landed(job, t))
        return True

    def _start(self, now: float) -> None:
        self._admit(now)
        budget = self._gpu.step_tokens - len(self._decoding)
        chunks: list[tuple[Job, int]] = []
        prefill: list[tuple[int, int]] = []
        for job in self._prefilling:
            if budget <= 0:
                break
            before = job.cached_tokens + job.computed
            take = min(budget, job.prompt - before)
            chunks.append((job, take))
            prefill.append((take, before))
            budget -= take
        decodes = len(self._decoding)
        if not chunks and not decodes:
            self._span = None
            self._cpu_changed(now)
            return
        if chunks:
            each = self._gpu.step_s(prefill, decodes, self._context)
            self._stream = decodes / each
            self._schedule_end(now, each * self._factor, 1, chunks)
            self._cpu_changed(now)
            return
        count = max(1, self._decoding[0][0] - self._steps)
        # the context grows by one token per request per step: the span's mean step
        mean_context = self._context + decodes * (count - 1) // 2
        each = self._gpu.step_s([], decodes, mean_context)
        self._stream = decodes / each
        self._schedule_end(now, each * self._factor, count, [])
        self._cpu_changed(now)

    def _cpu_changed(self, now: float) -> None:
        if self._cpu is not None:
            self._cpu.changed(now)

    def _end(self, now: float, version: int) -> None:
        span = self._span
        if span is None or span.version != version:
            return  # cut short (rule 5): a later end replaced this one
        self.busy_s += span.each * span.count
        self.steps_run += span.count
        self._steps += span.count
        self._context += len(self._decoding) * span.count
        while self._decoding and self._decoding[0][0] <= self._steps:
            _, _, job = heapq.heappop(self._decoding)
            self._context -= job.reserve
            self._used -= job.reserve
            job.finished = now
            self._host.finished(job, now)
        for job, take in span.chunks:
            job.computed += take
            if job.cached_tokens + job.computed >= job.prompt:
                self._prefilled(job, now)
        landing, self._landing = self._landing, []
        for job in landing:
            job.steps_left -= span.count
            if job.steps_left > 0:
                self._landing.append(job)
            else:
                self._waiting.appendleft(job)
        self._span = None
        self._start(now)

    def _prefilled(self, job: Job, now: float) -> None:
        """Rule 4."""
        self._prefilling.remove(job)
        job.first_token = now
        self._host.first_token(job, now)
        blocks = job.request.full_blocks
        if self._local:
            new, evicted = self.gpu_cache.insert(blocks)
            self._announce_stored(MEDIUM_GPU, blocks, set(new))
            self._announce_removed(MEDIUM_GPU, evicted)
            new, evicted = self.cpu_tier.insert(blocks)
            self._announce_stored(MEDIUM_CPU, blocks, set(new))
            self._announce_removed(MEDIUM_CPU, evicted)
        if job.request.output_length <= 1:
            self._used -= job.reserve
            job.finished = now
            self._host.finished(job, now)
            return
        self._seq += 1
        last = self._steps + job.request.output_length - 1
        heapq.heappush(self._decoding, (last, self._seq, job))
        self._context += job.prompt

    def stored_pulled(self, blocks: Sequence[int]) -> None:
        """A pull landed ``blocks`` (the prefix up to them) in this engine's CPU tier."""
        new, evicted = self.cpu_tier.insert(blocks)
        self._announce_stored(MEDIUM_CPU, blocks, set(new))
        self._announce_removed(MEDIUM_CPU, evicted)

    # --- KV events --------------------------------------------------------------------

    def _announce_stored(self, medium: str, blocks: Sequence[int], new: set[int]) -> None:
        """Each run of consecutive new blocks as one BlockStored, as vLLM announces them."""
        if not self._events or not new:
            return
        events: list[KVEvent] = []
        run: list[int] = []
        for i, block in enumerate(blocks):
            if block in new:
                if not run:
                    parent = blocks[i - 1] if i else None
                run.append(block)
                continue
            if run:
                events.append(self._stored(medium, run, parent))
                run = []
        if run:
            events.append(self._stored(medium, run, parent))
        self._host.publish(self.name, events)

    def _stored(self, medium: str, run: list[int], parent: int | None) -> BlocksStored:
        tokens: list[int] = []
        for block in run:
            tokens.extend(self._host.block_tokens(block))
        return BlocksStored.of_ids(medium, tuple(run), parent, tokens, self._bt)

    def _announce_removed(self, medium: str, evicted: list[int]) -> None:
        if self._events and evicted:
            self._host.publish(self.name, [BlocksRemoved(medium, tuple(evicted))])


PULL_STEPS = CONSUMER_PULL_STEPS  # rule 3: the product's own count of a pull's extra steps
