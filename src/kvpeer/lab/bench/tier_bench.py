"""``kvpeer bench tier``: tier overhead and memory, in memory (no sockets).

Three measurements, each against a baseline taken in the same run:

1. Per-step overhead of the tier (one engine step: ``get_finished_jobs``,
   ``serve_external_requests``, ``on_schedule_end``) with 10,000 idle requests,
   10,000 parked producer stores, and 10,000 consumer requests whose probes were
   answered, versus none. Work lists instead of scans keep these flat.
2. Memory per in-flight request (a PD request whose load is in flight).
3. Peak traced memory after 1,000 and after 100,000 complete PD requests (the
   tier must forget finished requests: the two should be equal).

With a ``scraper`` (``kvpeer bench tier --metrics``) every step of (1) is also
timed while a thread scrapes the stepping tier's full ``/metrics`` text at
:data:`SCRAPE_HZ` (reading under the lock the steps hold, like a live node),
interleaved with the same steps unscraped: metrics on vs off, same run.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvpeer.config import TierConfig
from kvpeer.node.tier import Tier
from kvpeer.session.results import StoreFinished
from kvpeer.testing.clock import FakeClock
from kvpeer.testing.dataplane import Fabric, FakeDataPlane, Region
from kvpeer.testing.network import MemoryNetwork
from kvpeer.testing.parent import FakeParent
from kvpeer.types import JobResult, RequestContext, TransferJob

__all__ = ["SCRAPE_HZ", "Scraper", "run"]

BLOCK_LEN = 64
KEYS_PER_REQUEST = 4
#: Scrapes per second while metrics are "on" (Prometheus' default is one per 15 s).
SCRAPE_HZ = 200.0
ROUND_S = 0.5  # each metrics-on and metrics-off round of steps
#: Given a tier and the lock its steps hold: a function doing one full scrape.
Scraper = Callable[[Tier, threading.Lock], Callable[[], object]]


@contextmanager
def scraping(scrape: Callable[[], object], hz: float = SCRAPE_HZ) -> Iterator[list[int]]:
    """A thread calling ``scrape`` ``hz`` times a second; yields ``[scrapes done]``."""
    done = [0]
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(1 / hz):
            scrape()
            done[0] += 1

    thread = threading.Thread(target=loop, name="bench-scraper", daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stop.set()
        thread.join(10)


@dataclass
class _Node:
    tier: Tier
    parent: FakeParent
    plane: FakeDataPlane


class _World:
    """Two tiers (``a`` consumes, ``b`` produces) over an in-memory network."""

    def __init__(self, num_blocks: int = 4096) -> None:
        #: What a live node's engine calls hold; a scraper reads under it.
        self.lock = threading.Lock()
        self.clock = FakeClock()
        self.net = MemoryNetwork(self.clock)
        self.fabric = Fabric()
        self.job_ids = itertools.count(1)
        self.a = self._node("a", 1, num_blocks)
        self.b = self._node("b", 2, num_blocks)
        self.seq = itertools.count()

    def _node(self, host: str, port: int, num_blocks: int) -> _Node:
        config = TierConfig.from_dict({"host": host, "port": port, "store_timeout_s": 1e6})
        region = Region(num_blocks, BLOCK_LEN)
        plane = FakeDataPlane(self.fabric, config.peer_id, region, auto_complete=True)
        tier = Tier(config, self.net.attach(config.peer_id), plane, clock=self.clock)
        return _Node(tier, FakeParent(region, self.job_ids), plane)

    def step(self, node: _Node) -> list[JobResult]:
        with self.lock:
            results = node.tier.get_finished_jobs()
            for result in results:
                if result.job_id in node.parent.open_jobs:
                    node.parent.job_finished(StoreFinished(result.job_id, result.success))
            node.tier.serve_external_requests(node.parent)
            node.tier.on_schedule_end()
        return results

    def settle(self, rounds: int = 6) -> None:
        for _ in range(rounds):
            self.step(self.a)
            self.step(self.b)

    def pd_request(self, *, finish: bool = True, keys_per_request: int = KEYS_PER_REQUEST) -> str:
        """One PD request: b prefills and stores, a loads; both finish if asked."""
        n = next(self.seq)
        kv_id = f"kv{n}"
        keys = [b"k%d-%d" % (n, i) for i in range(keys_per_request)]
        producer = RequestContext(f"p{n}", {"remote_decoder": {"kv_request_id": kv_id}})
        self.b.tier.on_new_request(producer)
        for key in keys:
            self.b.parent.put(key)
        job = self.b.parent.store_job(keys)
        self.b.tier.submit_store(TransferJob(job.job_id, job.keys, job.slots, producer))
        self.b.tier.on_request_finished(producer)
        self.b.parent.finished_jobs.clear()  # the fake's own history, not the tier's
        for key in keys:  # the producer's cache may evict them once the job is done
            slot = self.b.parent.slots.pop(key)
            self.b.parent._free.append(slot)
        consumer = RequestContext(
            f"c{n}",
            {"remote_prefiller": {"kv_request_id": kv_id, "remote_host": "b", "remote_port": 2}},
        )
        self.a.tier.on_new_request(consumer)
        slots = tuple(
            range(n % 512 * keys_per_request, n % 512 * keys_per_request + keys_per_request)
        )
        self.a.tier.submit_load(TransferJob(next(self.job_ids), tuple(keys), slots, consumer))
        if finish:
            self.settle()
            self.a.tier.on_request_finished(consumer)
            self.a.plane.cancelled.clear()
            self.b.plane.cancelled.clear()
        return kv_id


def _median_step_us(world: _World, node: _Node, steps: int = 300, seconds: float = 0.0) -> float:
    """Median of at least ``steps`` steps, taking at least ``seconds``."""
    samples: list[float] = []
    until = time.perf_counter() + seconds
    while len(samples) < steps or time.perf_counter() < until:
        start = time.perf_counter()
        world.step(node)
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _step_overhead(count: int, scraper: Scraper | None = None) -> dict[str, Any]:
    rows: list[tuple[str, float, float, dict[str, float]]] = []

    def measure(name: str, world: _World, node: _Node, baseline_us: float) -> None:
        if scraper is None:
            rows.append((name, _median_step_us(world, node), baseline_us, {}))
            return
        scrape = scraper(node.tier, world.lock)
        off: list[float] = []
        on: list[float] = []
        scrapes = 0
        seconds = 0.0
        for _ in range(3):  # interleaved: the machine's drift moves both alike
            off.append(_median_step_us(world, node, seconds=ROUND_S))
            started = time.perf_counter()
            with scraping(scrape) as done:
                on.append(_median_step_us(world, node, seconds=ROUND_S))
            seconds += time.perf_counter() - started
            scrapes += done[0]
        off_us, on_us = statistics.median(off), statistics.median(on)
        extra = {"step_us_scraped": on_us, "scrapes_per_s": scrapes / seconds}
        rows.append((name, off_us, baseline_us, extra))

    base = _World()
    base.pd_request()  # sessions exist in every scenario
    baseline = _median_step_us(base, base.b)
    baseline_a = _median_step_us(base, base.a)
    measure("no requests (producer)", base, base.b, baseline)

    idle = _World()
    idle.pd_request()
    for i in range(count):
        idle.b.tier.on_new_request(RequestContext(f"idle{i}", None))
    measure("idle requests (producer)", idle, idle.b, baseline)

    parked = _World()
    parked.pd_request()
    for i in range(count):
        ctx = RequestContext(f"pk{i}", {"remote_decoder": {"kv_request_id": f"pk{i}"}})
        parked.b.tier.on_new_request(ctx)
        parked.b.tier.submit_store(TransferJob(next(parked.job_ids), (), (), ctx))
    measure("parked producer stores", parked, parked.b, baseline)

    answered = _World()
    answered.pd_request()
    answered.b.parent.put(b"shared")
    contexts = []
    for i in range(count):
        ctx = RequestContext(
            f"s{i}",
            {"remote_kv_source": {"kv_request_id": f"s{i}", "remote_host": "b", "remote_port": 2}},
        )
        answered.a.tier.on_new_request(ctx)
        answered.a.tier.lookup(b"shared", ctx)
        contexts.append(ctx)
    answered.settle(10)
    measure("consumers with answered probes", answered, answered.a, baseline_a)
    out: list[dict[str, Any]] = []
    for name, us, base_us, extra in rows:
        if name.startswith("no requests") and scraper is None:
            continue  # the baseline itself: only worth a row next to its scraped time
        row: dict[str, Any] = {
            "scenario": name,
            "step_us": round(us, 1),
            "baseline_us": round(base_us, 1),
            "ratio": round(us / base_us, 2),
        }
        if extra:
            row["step_us_scraped"] = round(extra["step_us_scraped"], 1)
            row["scraped_ratio"] = round(extra["step_us_scraped"] / us, 2)
            row["scrapes_per_s"] = round(extra["scrapes_per_s"], 1)
        out.append(row)
    return {"requests": count, "rows": out}


_TIER_CODE = (
    tracemalloc.Filter(True, "*/kvpeer/node/*"),
    tracemalloc.Filter(True, "*/kvpeer/session/*"),
    tracemalloc.Filter(True, "*/kvpeer/protocol/*"),
)


def _traced(build: Callable[[], object]) -> tuple[int, int, object]:
    """(bytes still held by tier code, peak of everything, result) around ``build``.

    Only allocations made by the tier, session and protocol code count as held,
    so the benchmark's own fakes (parent, data plane) do not blur the answer.
    """
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot().filter_traces(_TIER_CODE)
    kept = build()
    gc.collect()
    after = tracemalloc.take_snapshot().filter_traces(_TIER_CODE)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    held = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return held, peak, kept


def _memory_per_inflight(count: int) -> dict[str, Any]:
    world = _World(num_blocks=count * KEYS_PER_REQUEST + 64)
    world.pd_request()
    world.settle()
    world.a.plane.auto_complete = False  # keep loads in flight
    world.b.plane.auto_complete = False

    def build() -> None:
        for _ in range(count):
            world.pd_request(finish=False)
        world.settle(2)

    current, _, _ = _traced(build)
    stats = world.a.tier.statistics()
    return {
        "requests_in_flight": count,
        "loads_in_flight": stats.loads_in_flight,
        "bytes_per_request": round(current / count),
    }


def _peak_after(total: int) -> int:
    world = _World()
    world.pd_request()

    def build() -> None:
        for _ in range(total):
            world.pd_request()
        world.clock.advance(1e4)
        world.settle()

    current, _, _ = _traced(build)
    return current


def run(*, quick: bool = False, scraper: Scraper | None = None) -> dict[str, Any]:
    """``scraper``: also time every step while the tier's metrics are scraped."""
    count = 2_000 if quick else 10_000
    small, large = (200, 5_000) if quick else (1_000, 100_000)
    overhead = _step_overhead(count, scraper)
    inflight = _memory_per_inflight(200 if quick else 1_000)
    retained_small = _peak_after(small)
    retained_large = _peak_after(large)
    return {
        "step_overhead": overhead,
        "memory_per_inflight_request": inflight,
        "retained_memory": {
            "after_requests": [small, large],
            "bytes": [retained_small, retained_large],
            "ratio": round(retained_large / max(retained_small, 1), 2),
        },
    }


def render(result: dict[str, Any]) -> str:
    rows = result["step_overhead"]["rows"]
    scraped = bool(rows) and "step_us_scraped" in rows[0]
    lines = [f"tier step overhead with {result['step_overhead']['requests']:,} requests vs none"]
    header = f"  {'scenario':34} {'step µs':>9} {'none µs':>9} {'ratio':>6}"
    if scraped:
        header += f"  {'metrics on µs':>13} {'on/off':>6} {'scrapes/s':>9}"
    lines.append(header)
    for row in rows:
        line = (
            f"  {row['scenario']:34} {row['step_us']:9.1f} {row['baseline_us']:9.1f} "
            f"{row['ratio']:6.2f}"
        )
        if scraped:
            line += (
                f"  {row['step_us_scraped']:13.1f} {row['scraped_ratio']:6.2f} "
                f"{row['scrapes_per_s']:9.0f}"
            )
        lines.append(line)
    if scraped:
        lines.append(
            "  (metrics on: a thread scrapes the stepping tier's full /metrics text, "
            "reading under the steps' lock)"
        )
    inflight = result["memory_per_inflight_request"]
    lines.append(
        f"memory per in-flight PD request: {inflight['bytes_per_request']:,} bytes "
        f"({inflight['requests_in_flight']:,} in flight)"
    )
    kept = result["retained_memory"]
    lines.append(
        f"memory retained after {kept['after_requests'][0]:,} requests: {kept['bytes'][0]:,} B; "
        f"after {kept['after_requests'][1]:,}: {kept['bytes'][1]:,} B "
        f"(ratio {kept['ratio']})"
    )
    return "\n".join(lines)
