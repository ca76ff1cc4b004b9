"""``kvpeer bench router-scale``: the router's data layer as the fleet grows.

Synthetic engines (:class:`SyntheticEngine`) run a vLLM-shaped workload on a simulated
clock and publish what vLLM 0.32 publishes for it: one msgpack ``KVEventBatch`` per
step that changed the cache. The GPU prefix cache announces a request's new blocks in
one ``BlockStored`` (a hit is not announced again) and each evicted block in a
``BlockRemoved`` of its own, as its block pool does; the CPU tier (self-describing)
announces every stored block in a ``BlockStored`` of its own and a store's evictions in
one ``BlockRemoved``. Each fleet size runs in three phases:

1. **Warm-up** (memory): the engines fill their caches and evict for a while; the
   router's intake (``EventFeed`` -> ``decode_batch`` -> ``PrefixIndex``) follows every
   batch. The index's memory is then the size of every object it reaches
   (``sys.getsizeof``, each object once), divided by the blocks it holds.
2. **Window** (CPU): ``seconds`` of simulated traffic, published first; then each
   router takes all of it, one after the other, with only the intake on the process
   CPU clock (one thread: one core). The engines' own work (hashing, encoding) is
   outside the timed spans. Events per CPU-second against the events per second the
   fleet publishes says whether one core keeps up.
3. **Decisions**: ``RouterPolicy.plan`` (shared mode, every engine healthy, random
   loads) for prompts of three kinds -- a second turn of a conversation an engine
   served (that engine holds it), a known system prompt with a new question, and a
   prompt nobody holds -- each timed alone; p50/p99. Every decision that predicts
   cached tokens is checked against the engines' own caches: the engine it names
   (server, or the source it pulls from) must hold at least that prefix.

Socket costs (ZMQ receive on the router's event loop) are not in the window.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import statistics
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import islice
from types import BuiltinFunctionType, FunctionType, ModuleType
from typing import Any

import msgspec

from kvpeer.router import events as events_module
from kvpeer.router import index as index_module
from kvpeer.router import indexloops
from kvpeer.router.decide import RouterPolicy
from kvpeer.router.feed import EventFeed
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex
from kvpeer.router.policy import EngineLoad, EngineSpec, Mode

__all__ = [
    "RouterScaleSpec",
    "SyntheticEngine",
    "add_arguments",
    "render",
    "run",
    "run_fleet",
]

Progress = Callable[[str], None]
STEP_S = 0.05  # one engine step; vLLM publishes at most one batch per step
VOCAB = 1 << 16  # token ids drawn below this (two random bytes each)
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class RouterScaleSpec:
    fleets: tuple[int, ...] = (16, 64, 256)
    seconds: float = 4.0  # simulated seconds of the timed window
    warmup_s: float = 2.0  # simulated seconds of evictions after the caches filled
    requests_per_s: float = 8.0  # per engine
    prompt_tokens: int = 2048
    prefix_tokens: int = 1024  # of which a system prompt shared across the fleet
    system_prompts: int = 64
    block_size: int = 16
    gpu_blocks: int = 2000  # per engine: once full, every new block evicts one
    cpu_blocks: int = 4000
    decisions: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.fleets or min(self.fleets) < 1:
            raise ValueError(f"fleets must be positive engine counts, got {self.fleets}")
        if not 0 < self.prefix_tokens < self.prompt_tokens:
            raise ValueError("prefix_tokens must be between 0 and prompt_tokens")
        for key in ("requests_per_s", "seconds", "block_size", "gpu_blocks", "cpu_blocks",
                    "decisions", "system_prompts"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterScaleSpec:
        base = cls(fleets=(4, 16), seconds=1.0, warmup_s=0.5, decisions=300) if args.quick \
            else cls()
        fleets = tuple(int(n) for n in args.engines.split(",")) if args.engines else base.fleets
        return cls(
            fleets=fleets,
            seconds=args.seconds or base.seconds,
            warmup_s=base.warmup_s,
            requests_per_s=args.requests_per_s or base.requests_per_s,
            decisions=args.decisions or base.decisions,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", help="fleet sizes, comma-separated (default 16,64,256)")
    parser.add_argument("--seconds", type=float, help="simulated seconds timed (default 4)")
    parser.add_argument("--requests-per-s", type=float,
                        help="requests per engine and second (default 8)")
    parser.add_argument("--decisions", type=int, help="decisions timed per fleet (default 2000)")
    parser.add_argument("--quick", action="store_true", help="fleets 4,16 and 1 s: seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# -- synthetic engines ------------------------------------------------------------------


@dataclass(slots=True)
class _Cache:
    """One medium of one engine: an LRU of block hashes (vLLM evicts the least recent)."""

    capacity: int
    # A plain dict in LRU order (a touch deletes and re-inserts): holding only bytes, it
    # is never tracked by the garbage collector, whose full collections would otherwise
    # walk 256 engines' caches inside the router's timed intake (a router has no such
    # caches; the index's own maps are untracked the same way).
    blocks: dict[bytes, None] = field(default_factory=dict)


class SyntheticEngine:
    """An engine that hashes its blocks its own way (a per-process salt, as vLLM) and
    publishes vLLM 0.32's event batches for what its caches do."""

    def __init__(self, name: str, spec: RouterScaleSpec, rng: random.Random) -> None:
        self.name = name
        self._spec = spec
        self._rng = rng
        self._salt = rng.randbytes(16)
        self._media = {MEDIUM_GPU: _Cache(spec.gpu_blocks), MEDIUM_CPU: _Cache(spec.cpu_blocks)}
        self.batches = 0  # published; the next batch's seq
        self.served: deque[list[int]] = deque(maxlen=8)  # its last prompts, newest last
        self.events = 0

    def hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """This engine's chained hashes of the prompt's full blocks."""
        size = self._spec.block_size
        out: list[bytes] = []
        parent = self._salt
        for start in range(0, len(prompt) - size + 1, size):
            parent = hashlib.sha256(parent + array("I", prompt[start:start + size]).tobytes()
                                    ).digest()
            out.append(parent)
        return out

    def held(self, medium: str) -> int:
        """Blocks this engine holds in ``medium`` now."""
        return len(self._media[medium].blocks)

    def holds_tokens(self, prompt: Sequence[int]) -> int:
        """Tokens of the prompt's longest prefix this engine holds (either medium)."""
        blocks = 0
        for block_hash in self.hashes(prompt):
            if not any(block_hash in cache.blocks for cache in self._media.values()):
                break
            blocks += 1
        return blocks * self._spec.block_size

    def step(self, prompts: Sequence[list[int]], now: float) -> list[bytes] | None:
        """Run one step that prefills ``prompts``: the PUB frames of its batch, or None
        when the step changed no cache."""
        events: list[dict[str, Any]] = []
        size = self._spec.block_size
        for prompt in prompts:
            hashes = self.hashes(prompt)
            self.served.append(prompt)
            for medium, cache in self._media.items():
                gpu = medium == MEDIUM_GPU
                # A hit announces nothing (vLLM marks a request's hit blocks cached);
                # the rest is stored, a run of absent blocks per event on the GPU, one
                # event per block on the CPU tier (its events are self-contained).
                run: list[int] = []
                for i in range(len(hashes) + 1):
                    if i < len(hashes) and hashes[i] not in cache.blocks:
                        run.append(i)
                        if gpu:
                            continue
                    if run:
                        first, last = run[0], run[-1] + 1
                        events.append(_stored(hashes[first:last],
                                              hashes[first - 1] if first else None,
                                              prompt[first * size:last * size], size, medium))
                        for block_hash in hashes[first:last]:
                            cache.blocks[block_hash] = None
                        run = []
                    if i < len(hashes):
                        del cache.blocks[hashes[i]]
                        cache.blocks[hashes[i]] = None
                # Evictions: one BlockRemoved per block from the GPU block pool, one per
                # store from the CPU tier (its manager evicts a store's room at once).
                evicted = list(islice(cache.blocks, max(0, len(cache.blocks) - cache.capacity)))
                for block_hash in evicted:
                    del cache.blocks[block_hash]
                for chunk in ([[h] for h in evicted] if gpu else [evicted] if evicted else []):
                    events.append({"type": "BlockRemoved", "block_hashes": chunk,
                                   "medium": medium, "group_idx": 0})
        if not events:
            return None
        self.events += len(events)
        payload = _ENCODER.encode([time.time(), events, None])
        seq = self.batches
        self.batches += 1
        return [b"kv", seq.to_bytes(8, "big"), payload]


def _stored(hashes: list[bytes], parent: bytes | None, tokens: Sequence[int], size: int,
            medium: str) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": size, "lora_id": None, "medium": medium,
            "lora_name": None, "extra_keys": None, "group_idx": 0}


class _Workload:
    """Prompts: one of the fleet's system prompts, then tokens nobody sent before."""

    def __init__(self, spec: RouterScaleSpec, rng: random.Random) -> None:
        self._spec = spec
        self._rng = rng
        self.system = [self.tokens(spec.prefix_tokens) for _ in range(spec.system_prompts)]

    def tokens(self, n: int) -> list[int]:
        return list(array("H", self._rng.randbytes(2 * n)))

    def prompt(self) -> list[int]:
        s = self._spec
        return self._rng.choice(self.system) + self.tokens(s.prompt_tokens - s.prefix_tokens)


@dataclass(slots=True)
class _Router:
    """The router's intake: one feed per engine, all into one index."""

    index: PrefixIndex
    feeds: dict[str, EventFeed]

    @classmethod
    def of(cls, engines: Sequence[SyntheticEngine], spec: RouterScaleSpec,
           native: bool) -> _Router:
        index = PrefixIndex(spec.block_size, native=native)
        feeds = {e.name: EventFeed(can_replay=False, sink=partial(index.apply, e.name))
                 for e in engines}
        return cls(index, feeds)

    def take(self, batches: Sequence[tuple[str, list[bytes]]], now: float) -> None:
        with nullcontext() if self.index.native else without_c():
            for name, parts in batches:
                self.feeds[name].on_live(parts, now)


@contextmanager
def without_c() -> Iterator[None]:
    """The intake as a router without ``kvpeer.router._intake`` runs it: the events'
    translation and the chain keys' hashing in Python too (the index's loops are chosen
    per index: ``PrefixIndex(native=False)``)."""
    saved = (events_module._native_intake, index_module._chain, index_module._chain_keys)
    events_module._native_intake = None
    index_module._chain = indexloops.chain
    index_module._chain_keys = indexloops.chain_keys
    try:
        yield
    finally:
        (events_module._native_intake, index_module._chain, index_module._chain_keys) = saved


def _arrivals(rng: random.Random, rate: float) -> int:
    """Poisson arrivals in one step (Knuth's method: rates here are small)."""
    limit, k, p = pow(2.718281828459045, -rate), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def _steps(engines: Sequence[SyntheticEngine], workload: _Workload, rng: random.Random,
           rate: float, now: float) -> list[tuple[str, list[bytes]]]:
    """One step of every engine: the batches they published, in publish order."""
    batches = []
    for engine in engines:
        prompts = [workload.prompt() for _ in range(_arrivals(rng, rate * STEP_S))]
        if prompts:
            parts = engine.step(prompts, now)
            if parts is not None:
                batches.append((engine.name, parts))
    return batches


# -- one fleet --------------------------------------------------------------------------


def deep_size(root: object) -> int:
    """Bytes of ``root`` and every object it reaches (each counted once), classes,
    functions and modules aside: what the index itself holds."""
    skip = (type, ModuleType, FunctionType, BuiltinFunctionType)
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def _held(index: PrefixIndex, now: float) -> int:
    return sum(blocks for _, _, blocks in index.statistics(now).blocks)


def run_fleet(spec: RouterScaleSpec, engines_n: int, progress: Progress) -> dict[str, Any]:
    """All three phases for one fleet size; the result row."""
    rng = random.Random(spec.seed * 1_000_003 + engines_n)
    workload = _Workload(spec, rng)
    engines = [SyntheticEngine(f"e{i}", spec, rng) for i in range(engines_n)]
    # The router as it runs (the C loops when built), and beside it the same intake
    # with the Python loops (the fallback without a C compiler): the same-run baseline.
    probe = PrefixIndex(spec.block_size)
    routers = [_Router.of(engines, spec, native=False)]
    if probe.native:
        routers.insert(0, _Router.of(engines, spec, native=True))
    router = routers[0]
    now = 0.0
    # Warm-up: fill the caches (fast), then evict for warmup_s, all traced.
    blocks_per_request = (spec.prompt_tokens - spec.prefix_tokens) // spec.block_size
    fill_steps = int(spec.cpu_blocks / blocks_per_request / (spec.requests_per_s * STEP_S)) + 1
    warm_steps = fill_steps + int(spec.warmup_s / STEP_S)
    for _ in range(warm_steps):
        now += STEP_S
        batches = _steps(engines, workload, rng, spec.requests_per_s, now)
        for each in routers:
            each.take(batches, now)
    memory = deep_size(router.index)
    held = _held(router.index, now)
    progress(f"{engines_n} engines: warmed up ({held:,} blocks held, "
             f"{memory / max(1, held):.0f} bytes per block)")
    # Window: the engines' steps first, then each router takes all of them on the clock,
    # one router after the other, as a router alone would (taken in turns, each router
    # found its caches emptied by the other's step and the engines' work).
    before = sum(e.events for e in engines)
    window: list[tuple[float, list[tuple[str, list[bytes]]]]] = []
    for _ in range(int(spec.seconds / STEP_S)):
        now += STEP_S
        window.append((now, _steps(engines, workload, rng, spec.requests_per_s, now)))
    batches_n = sum(len(batches) for _, batches in window)
    cpus = [0.0] * len(routers)
    wall = 0.0
    for i, each in enumerate(routers):
        c0, w0 = time.process_time(), time.perf_counter()
        for at, batches in window:
            each.take(batches, at)
        cpus[i] = time.process_time() - c0
        if i == 0:
            wall = time.perf_counter() - w0
    del window
    cpu, python_cpu = cpus[0], cpus[-1]
    events = sum(e.events for e in engines) - before
    applied = sum(f.statistics().batches_applied for f in router.feeds.values())
    published = sum(e.batches for e in engines)
    progress(f"{engines_n} engines: {events:,} events in {spec.seconds:g} s, intake "
             f"{cpu:.2f} CPU-s ({'C' if router.index.native else 'Python'} loops), "
             f"{python_cpu:.2f} with the Python loops")
    del routers[1:]  # the baseline's index goes before the decisions are timed
    decisions = _decide(spec, engines, workload, router.index, rng, now)
    return {
        "engines": engines_n,
        "events": events,
        "batches": batches_n,
        "batches_published": published,
        "batches_applied": applied,
        "events_per_s": events / spec.seconds,
        "intake_cpu_s": cpu,
        "intake_wall_s": wall,
        "cpu_ms_per_1000_events": cpu / events * 1e6 if events else 0.0,
        "events_per_cpu_s": events / cpu if cpu else 0.0,
        "cores_needed": cpu / spec.seconds,
        "intake_loops": "C" if router.index.native else "Python",
        "python_intake_cpu_s": python_cpu,
        "python_cores_needed": python_cpu / spec.seconds,
        "blocks_held": held,
        "index_bytes": memory,
        "index_mib_per_million_blocks": memory / max(1, held) * 1e6 / (1 << 20),
        **decisions,
    }


def _decide(spec: RouterScaleSpec, engines: Sequence[SyntheticEngine], workload: _Workload,
            index: PrefixIndex, rng: random.Random, now: float) -> dict[str, Any]:
    specs = [EngineSpec(e.name, f"http://127.0.0.1:{8000 + i}", "127.0.0.1", 5710 + i)
             for i, e in enumerate(engines)]
    policy = RouterPolicy(specs, Mode.SHARED, index)
    by_name = {e.name: e for e in engines}
    seconds: list[float] = []
    cpu: list[float] = []
    checked = wrong = turn2 = turn2_holder = 0
    for i in range(spec.decisions):
        kind = i % 3
        holder: SyntheticEngine | None = None
        if kind == 0:  # a conversation's second turn, on whoever served its first
            holder = rng.choice(engines)
            first = rng.choice(holder.served)
            prompt = first + workload.tokens(spec.block_size * 4)
        elif kind == 1:
            prompt = workload.prompt()
        else:
            prompt = workload.tokens(spec.prompt_tokens)
        loads = {e.name: EngineLoad(True, rng.randrange(4), rng.randrange(4) * 512)
                 for e in engines}
        started, cpu_started = time.perf_counter(), time.thread_time()
        plan = policy.plan(f"r{i}", prompt, loads, now)
        seconds.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - cpu_started)
        if plan.predicted_cached_tokens:
            checked += 1
            named = plan.source or plan.engine
            if by_name[named].holds_tokens(prompt) < plan.predicted_cached_tokens:
                wrong += 1
        if holder is not None and holder.holds_tokens(prompt) >= len(prompt) // 2:
            turn2 += 1
            turn2_holder += holder.name in (plan.engine, plan.source)
    ordered, ordered_cpu = sorted(seconds), sorted(cpu)
    return {
        "decisions": len(seconds),
        "decision_p50_ms": _quantile(ordered, 0.50) * 1e3,
        "decision_p99_ms": _quantile(ordered, 0.99) * 1e3,
        "decision_cpu_p50_ms": _quantile(ordered_cpu, 0.50) * 1e3,
        "decision_cpu_p99_ms": _quantile(ordered_cpu, 0.99) * 1e3,
        "decision_mean_ms": statistics.fmean(seconds) * 1e3,
        "decisions_with_cache": checked,
        "decisions_naming_a_non_holder": wrong,
        "second_turns_held": turn2,
        "second_turns_to_holder": turn2_holder,
    }


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the run ----------------------------------------------------------------------------


def run(spec: RouterScaleSpec, progress: Progress) -> dict[str, Any]:
    rows = []
    for n in spec.fleets:
        progress(f"fleet of {n} engines")
        rows.append(run_fleet(spec, n, progress))
    return {"spec": {**asdict(spec), "fleets": list(spec.fleets)}, "fleets": rows}


def render(result: dict[str, Any]) -> str:
    s = result["spec"]
    lines = [
        f"kvpeer bench router-scale: {s['requests_per_s']:g} requests/s per engine of "
        f"{s['prompt_tokens']} tokens ({s['prefix_tokens']} a shared system prompt), block "
        f"{s['block_size']}, caches {s['gpu_blocks']} GPU + {s['cpu_blocks']} CPU blocks per "
        f"engine; {s['seconds']:g} s of events timed, {s['decisions']} decisions",
        f"{'engines':>8} {'events/s':>10} {'CPU ms/1k ev':>12} {'events/CPU-s':>12} "
        f"{'cores':>6} {'Py loops':>8} {'blocks held':>12} {'MiB/M blocks':>12} "
        f"{'p50 ms':>8} {'p99 ms':>8} "
        f"{'p50 CPU':>8} {'p99 CPU':>8} {'wrong':>6} {'turn 2 to holder':>16}",
    ]
    for r in result["fleets"]:
        lines.append(
            f"{r['engines']:8d} {r['events_per_s']:10.0f} {r['cpu_ms_per_1000_events']:12.2f} "
            f"{r['events_per_cpu_s']:12.0f} {r['cores_needed']:6.2f} "
            f"{r['python_cores_needed']:8.2f} {r['blocks_held']:12,d} "
            f"{r['index_mib_per_million_blocks']:12.1f} {r['decision_p50_ms']:8.3f} "
            f"{r['decision_p99_ms']:8.3f} {r['decision_cpu_p50_ms']:8.3f} "
            f"{r['decision_cpu_p99_ms']:8.3f} "
            f"{r['decisions_naming_a_non_holder']:>6} "
            f"{r['second_turns_to_holder']:>7}/{r['second_turns_held']:<8}"
        )
    loops = {r["intake_loops"] for r in result["fleets"]}
    lines.append("(cores: router cores the fleet's events need, intake only, with the "
                 f"{'/'.join(sorted(loops))} loops; Py loops: the same intake as a router "
                 "without the C extension runs it (translation, hashing and loops in Python), "
                 "in the same run; p50/p99: decision "
                 "wall time, p50/p99 CPU: its thread CPU time, which a shared machine's scheduler "
                 "does not inflate; wrong: decisions predicting cached tokens the named engine "
                 "does not hold)")
    return "\n".join(lines)
