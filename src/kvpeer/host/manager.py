"""The reference host: drives secondary tiers the way vLLM's tiering manager does.

:class:`TieringHost` owns a :class:`~kvpeer.host.pool.BlockPool` (the primary) and an
ordered list of :class:`~kvpeer.host.interface.SecondaryTier`. It lets kvpeer's tier run
in simulations, benchmarks and engines that are not vLLM. One thread calls it.

Invariants:

1. One job-id counter serves promotions, cascades and serve pins. Every job is
   registered to the tier it was given to and leaves the registry when that tier
   reports it; a result with an id that tier does not hold (never issued, already
   reported, or another tier's) raises ``RuntimeError`` naming both: a tier bug is loud.
2. A promotion reserves its slots (WRITING) when a lookup stages it and is submitted at
   the next step as one ``submit_load`` per (tier, request); its result makes the slots
   READY or frees them. A cascade or serve job pins its slots once per job; the result
   unpins them, whatever ``success`` says.
3. Blocks the engine stores are WRITING until :meth:`TieringHost.complete_writes` (the
   next step): then READY, then cascaded to every tier. Tiers that asked REQUEST_LEVEL
   for the request also get the request's blocks that were already resident, once per
   request: READY ones at ``store`` time, WRITING ones when their write completes
   (vLLM skips those; a warm producer needs them).
4. ``on_request_finished`` reaches a tier only after the request's awaited writes
   completed and its staged promotions were submitted, and exactly once.
5. A tier reaches the parent only through the facade given to its
   ``serve_external_requests``; the facade dies when that call returns. It never asks
   the calling tier, it answers serve lookups like engine lookups (another tier's HIT
   stages a promotion and answers HIT_PENDING), and ``create_store_job`` pins only the
   keys still READY, so the job may hold fewer keys than asked.
6. Tier answers: HIT_PENDING from a secondary tier counts as RETRY (it cannot be loaded
   yet). Finished jobs are polled only by :meth:`TieringHost.step`,
   :meth:`TieringHost.drain` and :meth:`TieringHost.shutdown`.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from kvpeer.host.interface import SecondaryTier
from kvpeer.host.pool import BlockPool, PoolStatistics, SlotState
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

__all__ = ["HostStatistics", "JobKind", "StepReport", "StoreOutcome", "TieringHost"]

# Members the hot paths compare against, bound once: ``Enum.MEMBER`` goes through
# EnumType.__getattr__ on Python 3.11 (~0.2 us an access, millions per simulated world).
_HIT: Final = LookupResult.HIT
_HIT_PENDING: Final = LookupResult.HIT_PENDING
_MISS: Final = LookupResult.MISS
_RETRY: Final = LookupResult.RETRY


class JobKind(enum.Enum):
    PROMOTION = "promotion"  # tier -> primary, into slots reserved WRITING
    CASCADE = "cascade"  # primary -> tier, pinned slots, submitted by the host
    SERVE = "serve"  # primary slots a tier pinned through the parent


@dataclass(frozen=True, slots=True)
class StepReport:
    """What the host did over a span: one step, or (in statistics) its whole life."""

    writes_completed: int = 0
    cascade_jobs_submitted: int = 0
    promotion_jobs_submitted: int = 0
    serve_jobs_created: int = 0
    jobs_finished: int = 0
    jobs_failed: int = 0
    requests_finished: int = 0  # on_request_finished forwarded (engine and serve)


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """What :meth:`TieringHost.store` did with the blocks it was given."""

    written: int  # newly written, READY at the next complete_writes()
    resident: int  # already in the primary (READY or WRITING)
    dropped: int  # no slot could be allocated: every slot pinned or WRITING


@dataclass(frozen=True, slots=True)
class HostStatistics:
    promotions_in_flight: int
    cascades_in_flight: int
    serve_jobs_in_flight: int
    queued_promotion_keys: int  # staged by lookups, submitted at the next step
    pending_writes: int  # stored blocks not yet completed
    open_requests: int  # engine requests not yet finished by the engine
    open_serve_requests: int  # serve requests a tier has not finished yet
    deferred_finishes: int  # finished by their owner, not yet forwarded to tiers
    totals: StepReport
    pool: PoolStatistics


@dataclass(frozen=True, slots=True)
class _Job:
    kind: JobKind
    tier: int
    keys: tuple[Key, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _PrimaryWrite:
    request_id: str
    keys: tuple[Key, ...]
    slots: tuple[int, ...]


@dataclass(slots=True, eq=False)
class _Request:
    context: RequestContext
    request_level_tiers: tuple[int, ...] = ()
    serving_tier: int | None = None  # serve requests: the tier whose window opened it
    awaited_slots: set[int] = field(default_factory=set)  # writes that must finish first
    queued_promotions: int = 0
    cascaded: set[Key] = field(default_factory=set)
    finishing: bool = False


class TieringHost:
    """Primary pool + ordered secondary tiers, driven like vLLM's tiering manager."""

    def __init__(self, pool: BlockPool, tiers: Sequence[SecondaryTier]) -> None:
        self._pool = pool
        self._tiers = tuple(tiers)
        self._last_job_id = 0
        self._jobs: dict[int, _Job] = {}
        self._requests: dict[str, _Request] = {}
        self._pending_writes: list[_PrimaryWrite] = []
        self._waiters: dict[int, list[str]] = {}  # WRITING slot -> requests awaiting it
        self._promotions: dict[tuple[int, str], list[tuple[Key, int]]] = {}
        self._finishing: dict[str, _Request] = {}  # finished by their owner, not yet released
        self._totals: dict[str, int] = dict.fromkeys(_REPORT_FIELDS, 0)
        self._closed = False

    @property
    def pool(self) -> BlockPool:
        return self._pool

    # -- engine requests -----------------------------------------------------------

    def new_request(self, context: RequestContext) -> OffloadPolicy:
        """Announce a request to every tier; REQUEST_LEVEL if any tier asked for it."""
        self._check_open()
        if context.req_id in self._requests:
            raise RuntimeError(f"request {context.req_id!r} is already open")
        asked = tuple(
            index
            for index, tier in enumerate(self._tiers)
            if tier.on_new_request(context) is OffloadPolicy.REQUEST_LEVEL
        )
        self._requests[context.req_id] = _Request(context, request_level_tiers=asked)
        return OffloadPolicy.REQUEST_LEVEL if asked else OffloadPolicy.CHUNK_LEVEL

    def lookup(self, key: Key, context: RequestContext) -> LookupResult:
        """The engine's lookup of one key: primary first, then the tiers in order."""
        return self._lookup(key, self._engine_request(context), exclude=None)

    def lookup_prefix(self, keys: Sequence[Key], context: RequestContext) -> tuple[int, bool]:
        """The scheduler's prefix scan: (blocks counted as hits, whether to defer).

        HIT counts; HIT_PENDING counts and defers; RETRY defers and the scan goes on
        (so later lookups get started); the first MISS ends the scan.
        """
        hits, deferred = 0, False
        if not keys:
            return hits, deferred
        request = self._engine_request(context)  # a lookup never ends a request
        primary = self._pool.lookup
        for key in keys:
            result = primary(key)  # most of a scan: resident blocks
            if result is _MISS:
                result = self._lookup_tiers(key, request, exclude=None)
            if result is _MISS:
                break
            if result is not _RETRY:
                hits += 1
            if result is not _HIT:
                deferred = True
        return hits, deferred

    def store(
        self, context: RequestContext, keys: Sequence[Key], blocks: Sequence[bytes]
    ) -> StoreOutcome:
        """The engine computed ``blocks``: write the ones not resident (WRITING for now)."""
        request = self._engine_request(context)
        if len(keys) != len(blocks):
            raise ValueError(f"store: {len(keys)} keys but {len(blocks)} blocks")
        for key, block in zip(keys, blocks, strict=True):
            if len(block) != self._pool.block_len:
                raise ValueError(
                    f"store: block of key {key.hex()} is {len(block)} bytes, "
                    f"a block is {self._pool.block_len}"
                )
        ready: list[Key] = []
        to_write: list[tuple[Key, bytes]] = []
        resident = 0
        for key, block in zip(keys, blocks, strict=True):
            found = self._pool.lookup(key)
            if found is _MISS:
                to_write.append((key, block))
                continue
            resident += 1
            if not request.request_level_tiers or key in request.cascaded:
                continue
            if found is _HIT:
                ready.append(key)
                request.cascaded.add(key)
            else:
                self._await(request, key)
        # Cascading pins the resident blocks before allocation could evict them.
        self._cascade(request, request.request_level_tiers, ready)
        written_keys: list[Key] = []
        written_slots: list[int] = []
        for key, block in to_write:
            if self._pool.slot_of(key) is not None:  # listed twice in this call
                resident += 1
            elif (slot := self._pool.allocate(key)) is not None:
                self._pool.write(slot, block)
                request.awaited_slots.add(slot)
                written_keys.append(key)
                written_slots.append(slot)
        if written_keys:
            self._pending_writes.append(
                _PrimaryWrite(context.req_id, tuple(written_keys), tuple(written_slots))
            )
        written = len(written_keys)
        return StoreOutcome(written, resident, dropped=len(keys) - written - resident)

    def complete_writes(self) -> int:
        """The engine's copies into the primary finished: READY, cascade, release finishes."""
        self._check_open()
        writes, self._pending_writes = self._pending_writes, []
        late: dict[str, list[Key]] = {}
        count = 0
        for write in writes:
            request = self._requests[write.request_id]
            for key, slot in zip(write.keys, write.slots, strict=True):
                self._pool.complete_write(slot, True)
                request.awaited_slots.discard(slot)
                request.cascaded.add(key)
                self._settle_waiters(slot, key, True, late)
            self._cascade(request, range(len(self._tiers)), write.keys)
            count += len(write.keys)
        self._cascade_late(late)
        self._count("writes_completed", count)
        self._release_ready_finishes()
        return count

    def finish_request(self, context: RequestContext) -> None:
        """The engine is done with the request; tiers hear of it once its writes are done."""
        self._begin_finish(self._engine_request(context))

    # -- stepping ------------------------------------------------------------------

    def step(self) -> StepReport:
        """One engine step, in vLLM's order; returns what it did."""
        self._check_open()
        before = tuple(self._totals.values())
        self.complete_writes()
        for index in range(len(self._tiers)):
            self._poll(index)
        for index, tier in enumerate(self._tiers):
            parent = _TierParent(self, index)
            try:
                tier.serve_external_requests(parent)
            finally:
                parent.revoke()
        self._flush_promotions()
        for tier in self._tiers:
            tier.on_schedule_end()
        self._release_ready_finishes()
        after = tuple(self._totals.values())
        if after == before:
            return _IDLE_STEP  # most steps (frozen, so one instance serves them all)
        return StepReport(*map(operator.sub, after, before))

    def has_pending_work(self) -> bool:
        if self._pending_writes or self._promotions or self._jobs:
            return True
        return any(tier.has_pending_work() for tier in self._tiers)

    def drain(self) -> None:
        """Wait for every tier's transfers to stop touching the primary; consume results."""
        self._check_open()
        for index, tier in enumerate(self._tiers):
            tier.drain_jobs()
            self._poll(index)
        self._release_ready_finishes()

    def shutdown(self) -> None:
        """Shut every tier down and consume the results they still report."""
        self._check_open()
        for index, tier in enumerate(self._tiers):
            tier.shutdown()
            self._poll(index)
        self._closed = True

    def statistics(self) -> HostStatistics:
        in_flight = dict.fromkeys(JobKind, 0)
        for job in self._jobs.values():
            in_flight[job.kind] += 1
        requests = self._requests.values()
        return HostStatistics(
            promotions_in_flight=in_flight[JobKind.PROMOTION],
            cascades_in_flight=in_flight[JobKind.CASCADE],
            serve_jobs_in_flight=in_flight[JobKind.SERVE],
            queued_promotion_keys=sum(len(queued) for queued in self._promotions.values()),
            pending_writes=sum(len(write.keys) for write in self._pending_writes),
            open_requests=sum(1 for r in requests if r.serving_tier is None and not r.finishing),
            open_serve_requests=sum(
                1 for r in requests if r.serving_tier is not None and not r.finishing
            ),
            deferred_finishes=len(self._finishing),
            totals=StepReport(**self._totals),
            pool=self._pool.statistics(),
        )

    # -- the parent, as the facade calls it ----------------------------------------

    def _serve_new_request(self, tier: int, serve: ServeRequest) -> None:
        if serve.req_id in self._requests:
            raise RuntimeError(
                f"{self._tier_name(tier)}: serve request {serve.req_id!r} is already open "
                "(or names an open engine request)"
            )
        context = RequestContext(req_id=serve.req_id)
        for index, other in enumerate(self._tiers):
            if index != tier:
                other.on_new_request(context)
        self._requests[serve.req_id] = _Request(context, serving_tier=tier)

    def _serve_lookup(self, tier: int, key: Key, serve: ServeRequest) -> LookupResult:
        return self._lookup(key, self._serve_request(tier, serve), exclude=tier)

    def _serve_store_job(self, tier: int, keys: Sequence[Key], serve: ServeRequest) -> StoreJob:
        self._serve_request(tier, serve)
        ready = tuple(
            key
            for key in keys
            if (slot := self._pool.slot_of(key)) is not None
            and self._pool.state(slot) is SlotState.READY
        )
        slots = tuple(self._slot(key) for key in ready)
        self._pool.pin(slots)
        job_id = self._register(JobKind.SERVE, tier, ready, slots)
        self._count("serve_jobs_created")
        return StoreJob(job_id, ready, slots)

    def _serve_finished(self, tier: int, serve: ServeRequest) -> None:
        self._begin_finish(self._serve_request(tier, serve))

    # -- internals -----------------------------------------------------------------

    def _lookup(self, key: Key, request: _Request, exclude: int | None) -> LookupResult:
        primary = self._pool.lookup(key)
        if primary is not _MISS:
            return primary
        return self._lookup_tiers(key, request, exclude)

    def _lookup_tiers(self, key: Key, request: _Request, exclude: int | None) -> LookupResult:
        """A key the primary misses: the tiers in order, but ``exclude``."""
        undecided = False
        for index, tier in enumerate(self._tiers):
            if index == exclude:
                continue
            answer = tier.lookup(key, request.context)
            if answer is _HIT:
                return self._stage_promotion(index, request, key)
            undecided = undecided or answer is not _MISS
        return _RETRY if undecided else _MISS

    def _stage_promotion(self, tier: int, request: _Request, key: Key) -> LookupResult:
        slot = self._pool.allocate(key)
        if slot is None:
            return _MISS  # the primary is full of pinned/WRITING slots
        self._promotions.setdefault((tier, request.context.req_id), []).append((key, slot))
        request.queued_promotions += 1
        return _HIT_PENDING

    def _flush_promotions(self) -> None:
        staged, self._promotions = self._promotions, {}
        for (tier, request_id), entries in staged.items():
            request = self._requests[request_id]
            request.queued_promotions -= len(entries)
            keys = tuple(key for key, _ in entries)
            slots = tuple(slot for _, slot in entries)
            job_id = self._register(JobKind.PROMOTION, tier, keys, slots)
            self._count("promotion_jobs_submitted")
            self._tiers[tier].submit_load(TransferJob(job_id, keys, slots, request.context))

    def _cascade(self, request: _Request, tiers: Sequence[int], keys: Sequence[Key]) -> None:
        """One store job per tier of ``keys`` (all READY), each pinning its slots."""
        if not keys:
            return
        slots = tuple(self._slot(key) for key in keys)
        for tier in tiers:
            self._pool.pin(slots)
            job_id = self._register(JobKind.CASCADE, tier, tuple(keys), slots)
            self._count("cascade_jobs_submitted")
            self._tiers[tier].submit_store(TransferJob(job_id, tuple(keys), slots, request.context))

    def _await(self, request: _Request, key: Key) -> None:
        """A REQUEST_LEVEL block still WRITING: cascade it to the request when it lands."""
        slot = self._slot(key)
        if slot not in request.awaited_slots:  # its own write already cascades everywhere
            request.awaited_slots.add(slot)
            self._waiters.setdefault(slot, []).append(request.context.req_id)

    def _settle_waiters(
        self, slot: int, key: Key, success: bool, late: dict[str, list[Key]]
    ) -> None:
        for request_id in self._waiters.pop(slot, ()):
            request = self._requests[request_id]
            request.awaited_slots.discard(slot)
            if success and key not in request.cascaded:
                request.cascaded.add(key)
                late.setdefault(request_id, []).append(key)

    def _cascade_late(self, late: dict[str, list[Key]]) -> None:
        for request_id, keys in late.items():
            request = self._requests[request_id]
            self._cascade(request, request.request_level_tiers, keys)

    def _poll(self, tier: int) -> None:
        late: dict[str, list[Key]] = {}
        for result in self._tiers[tier].get_finished_jobs():
            self._consume(tier, result, late)
        self._cascade_late(late)

    def _consume(self, tier: int, result: JobResult, late: dict[str, list[Key]]) -> None:
        job = self._jobs.get(result.job_id)
        if job is None or job.tier != tier:
            if job is not None:
                why = f"it was submitted to {self._tier_name(job.tier)}"
            elif 0 < result.job_id <= self._last_job_id:
                why = "it was already reported (duplicate result)"
            else:
                why = "no such job was ever issued"
            raise RuntimeError(f"{self._tier_name(tier)} reported job {result.job_id}, but {why}")
        del self._jobs[result.job_id]
        self._count("jobs_finished")
        self._count("jobs_failed", int(not result.success))
        if job.kind is JobKind.PROMOTION:
            for key, slot in zip(job.keys, job.slots, strict=True):
                self._pool.complete_write(slot, result.success)
                self._settle_waiters(slot, key, result.success, late)
        else:
            self._pool.unpin(job.slots)

    def _begin_finish(self, request: _Request) -> None:
        request.finishing = True
        self._finishing[request.context.req_id] = request
        self._release_ready_finishes()

    def _release_ready_finishes(self) -> None:
        for request_id, request in list(self._finishing.items()):
            if not request.awaited_slots and not request.queued_promotions:
                del self._finishing[request_id]
                del self._requests[request_id]
                for index, tier in enumerate(self._tiers):
                    if index != request.serving_tier:
                        tier.on_request_finished(request.context)
                self._count("requests_finished")

    def _register(
        self, kind: JobKind, tier: int, keys: tuple[Key, ...], slots: tuple[int, ...]
    ) -> int:
        self._last_job_id += 1
        self._jobs[self._last_job_id] = _Job(kind, tier, keys, slots)
        return self._last_job_id

    def _slot(self, key: Key) -> int:
        slot = self._pool.slot_of(key)
        if slot is None:
            raise AssertionError(f"key {key.hex()} should be resident")
        return slot

    def _engine_request(self, context: RequestContext) -> _Request:
        self._check_open()
        request = self._requests.get(context.req_id)
        if request is None or request.serving_tier is not None or request.finishing:
            raise RuntimeError(f"request {context.req_id!r} is not an open engine request")
        return request

    def _serve_request(self, tier: int, serve: ServeRequest) -> _Request:
        request = self._requests.get(serve.req_id)
        if request is None or request.serving_tier != tier or request.finishing:
            raise RuntimeError(
                f"{self._tier_name(tier)}: serve request {serve.req_id!r} is not open "
                "for this tier (on_new_request first; on_request_finished only once)"
            )
        return request

    def _count(self, name: str, amount: int = 1) -> None:
        self._totals[name] += amount

    def _tier_name(self, tier: int) -> str:
        return f"tier {tier} ({type(self._tiers[tier]).__name__})"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the host was shut down")


# The order of the totals (TieringHost.__init__) and of StepReport's positional fields.
_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(StepReport))
_IDLE_STEP = StepReport()


class _TierParent:
    """The :class:`~kvpeer.session.ports.Parent` one tier sees during one serve window."""

    __slots__ = ("_host", "_tier", "_valid")

    def __init__(self, host: TieringHost, tier: int) -> None:
        self._host = host
        self._tier = tier
        self._valid = True

    def revoke(self) -> None:
        self._valid = False

    def on_new_request(self, request: ServeRequest) -> None:
        self._check()
        self._host._serve_new_request(self._tier, request)

    def lookup(self, key: Key, request: ServeRequest) -> LookupResult:
        self._check()
        return self._host._serve_lookup(self._tier, key, request)

    def create_store_job(self, keys: Sequence[Key], request: ServeRequest) -> StoreJob:
        self._check()
        return self._host._serve_store_job(self._tier, keys, request)

    def on_request_finished(self, request: ServeRequest) -> None:
        self._check()
        self._host._serve_finished(self._tier, request)

    def _check(self) -> None:
        if not self._valid:
            raise RuntimeError(f"tier {self._tier} used its parent outside serve_external_requests")
