"""One simulated engine: a reference host driving a kvpeer tier, and its requests.

A :class:`SimNode` keeps its identity (``n<i>:5710``) across deaths; each
boot builds a fresh :class:`Incarnation` (pool, region, fake data plane,
tier, host, and its held blocks if it has any: :mod:`kvpeer.lab.sim.held`) with a
new boot id. Between the host and the tier sits a
:class:`TierProbe` that sees every job in both directions, so the checker
knows, without reading the tier's internals:

1. every job the host submitted (loads, stores) or the tier pinned through
   the parent (serve jobs), when, and for which ``kv_request_id``;
2. that each is reported exactly once, and every successful load's slots
   hold exactly :meth:`Blocks.content` of its keys when it is reported;
3. the requests the tier was told about and has not been told are finished.

Requests run like a scheduler would run them: each stage looks its prefix up
until the host no longer defers it, computes (stores) the stage, and the
request finishes a few steps after its last stage (or earlier, at random).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from kvpeer.host import BlockPool, TieringHost
from kvpeer.lab.sim.ahead import ALLOWED, AheadProfile, TokenBook
from kvpeer.lab.sim.held import HeldProfile, WatchedHeld
from kvpeer.lab.sim.sim_network import SimNetwork
from kvpeer.lab.sim.timeouts import SimContext, Timeouts
from kvpeer.node.ahead import row_copier
from kvpeer.node.params import Routing, parse_transfer_params
from kvpeer.node.tier import Tier
from kvpeer.session.ports import Parent, TransferEvent
from kvpeer.testing.dataplane import Fabric, FakeDataPlane, Region
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.types import (
    JobResult,
    Key,
    LookupResult,
    OffloadPolicy,
    RequestContext,
    ServeRequest,
    StoreJob,
    TransferJob,
)

__all__ = [
    "Incarnation",
    "OpenJob",
    "SimDataPlane",
    "SimNode",
    "SimRegion",
    "SimRequest",
    "TierProbe",
]

LOAD, STORE, SERVE = "load", "store", "serve"
_HIT: Final = LookupResult.HIT  # bound once: slow on 3.11 (EnumType.__getattr__)
_RETRY: Final = LookupResult.RETRY


class SimRegion(Region):
    """A node's primary region as peers write it; remembers which slots they wrote."""

    def __init__(self, pool: BlockPool, ctx: SimContext) -> None:
        super().__init__(pool.num_blocks, pool.block_len, memory=pool.view)
        self.dirty: set[int] = set()
        self._ctx = ctx

    def write(self, slot: int, data: bytes) -> None:
        if self._ctx.corrupt_loads:  # negative control: the checker must notice
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        super().write(slot, data)
        self.dirty.add(slot)


class SimDataPlane(FakeDataPlane):
    """Writes move only while the network carries bytes between the two nodes: a
    partition or a frozen end stalls them (and a dead session drops them).

    The consumer's write windows are enforced, as the tcp plane does: a write a
    stalled producer resumes after the consumer gave up on it is refused.
    One-sided planes (shm, nixl) cannot refuse it; that residual risk is a
    property of those transports, documented in docs/behaviour.md, not of the logic
    under test here.

    With ``held`` it reads local slots ``num_blocks ..`` from the node's held copy,
    toward the peers whose planes read held rows (``HeldProfile.serves``), and tells
    the copy's watcher of every such read.
    """

    def __init__(
        self,
        network: SimNetwork,
        fabric: Fabric,
        node_id: str,
        region: Region,
        *,
        slow: bool,
        held: WatchedHeld | None = None,
    ) -> None:
        super().__init__(fabric, node_id, region, auto_complete=not slow, enforce_windows=True)
        self.network = network
        self.watched = held
        if held is not None:
            self.held = held.view

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        held = self.watched
        if held is not None and not held.serves_peer(peer_id):
            for slot in local_slots:
                if slot >= self.region.num_blocks:
                    self.violations.append(
                        f"a write toward {peer_id} reads held slot {slot}, but its plane "
                        "does not read held rows"
                    )
        return super().write_blocks(peer_id, local_slots, remote_slots)

    def read_block(self, slot: int) -> bytes:
        if self.watched is not None and slot >= self.region.num_blocks:
            self.watched.read(slot)
        return super().read_block(slot)

    def poll(self, peer_id: str) -> list[TransferEvent]:
        if self.auto_complete and self.pending and not self.network.carries(self.node_id, peer_id):
            self.auto_complete = False
            try:
                return super().poll(peer_id)
            finally:
                self.auto_complete = True
        return super().poll(peer_id)


@dataclass(slots=True, eq=False)
class OpenJob:
    kind: str  # LOAD, STORE or SERVE
    submitted: float
    deadline: float
    keys: tuple[Key, ...]
    slots: tuple[int, ...]
    kv_request_id: str | None  # load: the source id; store: the destination id
    peer_id: str | None = None  # load: the node pulled from
    probe: bool = False  # load: symmetric (probed) rather than PD
    overdue: bool = False


class _ParentProbe:
    """The host's parent as the tier sees it; records the serve jobs it pins."""

    __slots__ = ("_parent", "_probe")

    def __init__(self, parent: Parent, probe: TierProbe) -> None:
        self._parent = parent
        self._probe = probe

    def on_new_request(self, request: ServeRequest) -> None:
        self._parent.on_new_request(request)

    def lookup(self, key: Key, request: ServeRequest) -> LookupResult:
        return self._parent.lookup(key, request)

    def create_store_job(self, keys: Sequence[Key], request: ServeRequest) -> StoreJob:
        job = self._parent.create_store_job(keys, request)
        self._probe.opened(job.job_id, SERVE, job.keys, job.slots, request.kv_request_id)
        return job

    def on_request_finished(self, request: ServeRequest) -> None:
        self._parent.on_request_finished(request)


class TierProbe:
    """A transparent :class:`~kvpeer.host.interface.SecondaryTier` around a Tier."""

    def __init__(self, tier: Tier, where: str, pool: BlockPool, ctx: SimContext) -> None:
        self.tier = tier
        self.where = where
        self.peer_id = tier.peer_id
        self.pool = pool
        self.ctx = ctx
        self.open_jobs: dict[int, OpenJob] = {}
        self.routing: dict[str, Routing] = {}  # requests the tier knows as open
        self.failed_destinations: dict[str, float] = {}  # kv id -> last failed store
        # (source peer, kv id) -> when a request here pulling that id from that peer
        # last finished: our session toward each peer keeps its own entry per id
        self.finished_sources: dict[tuple[str, str], float] = {}
        self.key_loaded: dict[Key, float] = {}  # key -> when a load of it last reported
        # (source peer, wire id) of the fetches into staging running at the last check
        self.ahead_fetching: set[tuple[str, str]] = set()
        # req id -> key -> since when the tier answers RETRY for it (symmetric probes)
        self.retry_since: dict[str, dict[Key, float]] = {}
        self._answered: set[str] = set()  # PD requests the tier answered a lookup of
        self._source_users: dict[str, int] = {}  # kv id -> requests here that pulled it
        self._started: dict[str, float] = {}  # PD consumer request -> when it started
        self.jobs = 0
        self.loads_ok_pd = 0
        self.loads_ok_sym = 0
        self.loads_failed = 0

    # -- accounting ----------------------------------------------------------------

    def opened(
        self,
        job_id: int,
        kind: str,
        keys: tuple[Key, ...],
        slots: tuple[int, ...],
        kv_request_id: str | None,
        peer_id: str | None = None,
        probe: bool = False,
    ) -> None:
        bounds = self.ctx.bounds
        if kind == LOAD:
            limit = bounds.load
        elif kind == SERVE:
            limit = bounds.serve
        else:
            limit = bounds.producer_store if kv_request_id is not None else bounds.local_store
        now = self.ctx.clock.now
        if job_id in self.open_jobs:
            self.ctx.violate(self.where, f"job id {job_id} issued twice")
        self.open_jobs[job_id] = OpenJob(
            kind, now, now + limit, keys, slots, kv_request_id, peer_id, probe
        )
        self.jobs += 1

    def _settled(self, result: JobResult) -> None:
        job = self.open_jobs.pop(result.job_id, None)
        if job is None:
            self.ctx.violate(
                self.where, f"job {result.job_id} reported but not open (unknown or reported twice)"
            )
            return
        if job.kind == LOAD:
            now = self.ctx.clock.now
            for key in job.keys:
                self.key_loaded[key] = now
            if not result.success:
                self.loads_failed += 1
                return
            if job.probe:
                self.loads_ok_sym += 1
            else:
                self.loads_ok_pd += 1
            self._check_bytes(result.job_id, job)
        elif not result.success and job.kv_request_id is not None:
            self.failed_destinations[job.kv_request_id] = self.ctx.clock.now

    def _check_bytes(self, job_id: int, job: OpenJob) -> None:
        view = self.pool.view
        block_len = self.pool.block_len
        content = self.ctx.blocks.content
        for key, slot in zip(job.keys, job.slots, strict=True):
            start = slot * block_len
            if view[start : start + block_len] != content(key):
                self.ctx.violate(
                    self.where,
                    f"load job {job_id} ({job.kv_request_id} from {job.peer_id}) succeeded "
                    f"but slot {slot} does not hold the producer's bytes of key "
                    f"{key.hex()[:12]}",
                )
                return

    # -- SecondaryTier -------------------------------------------------------------

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        routing = parse_transfer_params(request.kv_transfer_params)
        self.routing[request.req_id] = routing
        if routing.source is not None and not routing.source.probe:
            kv_request_id = routing.source.kv_request_id
            self._source_users[kv_request_id] = self._source_users.get(kv_request_id, 0) + 1
            self._started[request.req_id] = self.ctx.clock.now
        return self.tier.on_new_request(request)

    def lookup(self, key: Key, request: RequestContext) -> LookupResult:
        result = self.tier.lookup(key, request)
        reach = self.ctx.reach
        routing = self.routing.get(request.req_id)
        source = routing.source if routing is not None else None
        if reach is None or source is None:
            return result
        req_id = request.req_id
        if source.probe:
            if result is _RETRY:
                streaks = self.retry_since.setdefault(req_id, {})
                since = streaks.setdefault(key, self.ctx.clock.now)
                reach.check_retry(self.tier, self.where, source.peer_id, req_id, since)
            elif req_id in self.retry_since:
                self.retry_since[req_id].pop(key, None)
        elif req_id not in self._answered:
            self._answered.add(req_id)
            if self._source_users[source.kv_request_id] > 1:
                return result  # a twin or a reused id: another request shares its fate
            reach.check_first_pd_lookup(
                self.where,
                self.peer_id,
                source.peer_id,
                req_id,
                result is _HIT,
                self._started.get(req_id, self.ctx.clock.now),
            )
        return result

    def submit_store(self, job: TransferJob) -> None:
        routing = self.routing.get(job.request.req_id)
        destination = routing.destination if routing is not None else None
        kv_request_id = destination.kv_request_id if destination is not None else None
        self.opened(job.job_id, STORE, job.keys, job.slots, kv_request_id)
        self.tier.submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        routing = self.routing.get(job.request.req_id)
        source = routing.source if routing is not None else None
        if source is None:
            self.opened(job.job_id, LOAD, job.keys, job.slots, None)
        else:
            self.opened(
                job.job_id,
                LOAD,
                job.keys,
                job.slots,
                source.kv_request_id,
                source.peer_id,
                source.probe,
            )
            toward = self.ctx.loads_toward.setdefault(source.peer_id, {})
            toward[source.kv_request_id] = self.ctx.clock.now
        self.tier.submit_load(job)

    def get_finished_jobs(self) -> list[JobResult]:
        results = self.tier.get_finished_jobs()
        for result in results:
            self._settled(result)
        return results

    def serve_external_requests(self, parent: Parent) -> None:
        self.tier.serve_external_requests(_ParentProbe(parent, self))

    def on_schedule_end(self) -> None:
        self.tier.on_schedule_end()

    def on_request_finished(self, request: RequestContext) -> None:
        self.retry_since.pop(request.req_id, None)
        self._answered.discard(request.req_id)
        self._started.pop(request.req_id, None)
        routing = self.routing.pop(request.req_id, None)
        if routing is not None and routing.source is not None:
            source = routing.source
            self.finished_sources[source.peer_id, source.kv_request_id] = self.ctx.clock.now
        self.tier.on_request_finished(request)

    def has_pending_work(self) -> bool:
        return self.tier.has_pending_work()

    def drain_jobs(self) -> None:
        self.tier.drain_jobs()

    def shutdown(self) -> None:
        self.tier.shutdown()


@dataclass(slots=True, eq=False)
class SimRequest:
    """One engine request: its prompt, its stages and when it finishes."""

    req_id: str
    ctx: RequestContext
    keys: tuple[Key, ...]
    cuts: tuple[int, ...]  # stage ends (chunked prefill / a prompt growing), last = len(keys)
    linger: int  # steps between the last stage and the finish
    finish_tick: int | None = None  # set early for requests that finish mid-flight
    stage: int = 0
    deferred_since: float | None = None
    best_hits: int = 0
    overdue: bool = False
    done: bool = False  # finished, or dropped with its node (never started counts too)


@dataclass(slots=True, eq=False)
class Incarnation:
    """Everything one boot of a node owns; discarded when the node dies."""

    pool: BlockPool
    region: SimRegion
    plane: SimDataPlane
    tier: Tier
    probe: TierProbe
    host: TieringHost
    held: WatchedHeld | None = None
    plane_violations_seen: int = 0


@dataclass(slots=True, eq=False)
class SimNode:
    """A node id that can die and boot again; ``live`` is None while it is dead."""

    index: int
    ctx: SimContext
    net: SimNetwork
    fabric: Fabric
    timeouts: Timeouts
    num_blocks: int
    block_len: int
    slow: bool = False  # its data plane completes writes only when the world says so
    complete_p: float = 1.0
    fail_p: float = 0.0
    busy_p: float = 0.0
    held: HeldProfile | None = None  # its tier keeps held blocks (kvpeer.lab.sim.held)
    held_type: type[WatchedHeld] = WatchedHeld  # another one: a negative control
    ahead: AheadProfile | None = None  # its tier pulls ahead (kvpeer.lab.sim.ahead)
    tokens: TokenBook | None = None  # the world's, when any node pulls ahead
    live: Incarnation | None = None
    boots: int = 0
    requests: dict[str, SimRequest] = field(default_factory=dict)
    stalled_until: int = -1  # a busy engine: no steps before this tick
    stalled_at: float = 0.0
    frozen: bool = False  # the stall is a frozen process (SIGSTOP), not a busy engine
    # Fixed by the index; fields, not properties: the checks ask for them every tick.
    name: str = field(init=False)
    peer_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = f"n{self.index}"
        self.peer_id = f"n{self.index}:5710"

    def boot(self, boot_id: bytes) -> Incarnation:
        config = self.timeouts.tier_config(self.name)
        assert config.peer_id == self.peer_id
        pool = BlockPool(self.num_blocks, self.block_len)
        region = SimRegion(pool, self.ctx)
        held = None
        if self.held is not None:
            config = replace(config, held_bytes=self.held.held_bytes)
            held = self.held_type(pool, self.held, self.ctx, self.name)
        plane = SimDataPlane(self.net, self.fabric, self.peer_id, region, slow=self.slow, held=held)
        control = self.net.attach(self.peer_id)
        if self.ahead is not None:
            config = replace(config, prefetch_from=ALLOWED, prefetch_ttl_s=self.ahead.ttl_s,
                             staging_blocks=self.ahead.rows)  # fmt: skip
        tier = Tier(config, control, plane, clock=self.ctx.clock, boot_id=boot_id, held=held)
        if self.ahead is not None and self.tokens is not None:
            whole = PrimaryRegion(pool.view, pool.num_blocks, pool.block_len)
            tier.configure_staging(pool.withhold(self.ahead.rows), self.tokens.keys_of,
                                   row_copier(whole), pool.block_len)  # fmt: skip
        probe = TierProbe(tier, self.name, pool, self.ctx)
        host = TieringHost(pool, [probe])
        self.live = Incarnation(pool, region, plane, tier, probe, host, held)
        self.boots += 1
        self.stalled_until = -1
        self.frozen = False
        return self.live

    def resume(self) -> None:
        """The stall ends: time it spent not stepping does not count against its own
        bounds (its timers fire at its next step, and frames sent to it wait)."""
        live = self.live
        assert live is not None
        if self.frozen:
            self.frozen = False
            self.net.thaw(self.peer_id)
        paused = self.ctx.clock.now - self.stalled_at
        for streaks in live.probe.retry_since.values():
            for key in streaks:
                streaks[key] += paused
        for job in live.probe.open_jobs.values():
            job.submitted += paused
            job.deadline += paused
        for pulled in live.probe.finished_sources:
            live.probe.finished_sources[pulled] += paused
        for table in (
            live.probe.failed_destinations,
            self.ctx.loads_toward.get(self.peer_id, {}),
        ):
            for name in table:
                table[name] += paused
        for request in self.requests.values():
            if request.deferred_since is not None:
                request.deferred_since += paused

    def kill(self) -> None:
        """The process vanishes: links to it die, nothing of it is checked any more."""
        self.net.kill(self.peer_id)
        self.live = None
        self.frozen = False
        for request in self.requests.values():
            request.done = True
        self.requests.clear()

    def start(self, request: SimRequest) -> None:
        assert self.live is not None
        self.live.host.new_request(request.ctx)
        self.requests[request.req_id] = request

    def run_requests(self, tick: int) -> None:
        """The scheduler's part of one step: lookups, computes and finishes."""
        live = self.live
        assert live is not None
        host = live.host
        ctx = self.ctx
        now = ctx.clock.now
        content = ctx.blocks.content
        loaded = live.probe.key_loaded
        for request in list(self.requests.values()):
            if request.finish_tick is not None and tick >= request.finish_tick:
                del self.requests[request.req_id]
                request.done = True
                host.finish_request(request.ctx)
                continue
            if request.stage >= len(request.cuts):
                continue
            part = request.keys[: request.cuts[request.stage]]
            hits, deferred = host.lookup_prefix(part, request.ctx)
            if deferred:
                # Progress: more hits, or a load of one of its keys (maybe another
                # request's, whose slot it waits on) reported since it was deferred.
                if (
                    request.deferred_since is None
                    or hits > request.best_hits
                    or max([loaded.get(key, 0.0) for key in part]) > request.deferred_since
                ):
                    request.deferred_since, request.best_hits = now, hits
                elif not request.overdue and now - request.deferred_since > ctx.bounds.deferred:
                    request.overdue = True
                    ctx.violate(
                        self.name,
                        f"request {request.req_id} deferred for "
                        f"{now - request.deferred_since:.2f}s without progress "
                        f"(bound {ctx.bounds.deferred:.2f}s; {request.ctx.kv_transfer_params})",
                    )
                continue
            request.deferred_since = None
            request.best_hits = 0
            host.store(request.ctx, part, [content(key) for key in part])
            request.stage += 1
            if request.stage == len(request.cuts):
                done = tick + request.linger
                request.finish_tick = (
                    done if request.finish_tick is None else min(done, request.finish_tick)
                )

    def finish_all(self) -> None:
        live = self.live
        assert live is not None
        for request in list(self.requests.values()):
            del self.requests[request.req_id]
            request.done = True
            live.host.finish_request(request.ctx)
