"""Producer bindings: which peer serves each ``remote_decoder`` id (docs/design.md §5.1, 5.6).

A PD producer's stores are known by ``kv_request_id`` only; the consumer that
will fetch them is not known until its fetch arrives on some session. This
module keeps the stores and fetches that wait for each other, and the memory of
ids whose stores were reaped. Sessions are reached only through a
:class:`Suppliers` port (the peer table), so it can be driven directly.

Invariants:

1. Stores for an id with no binding are *parked* until a fetch for the id
   arrives on some session, then handed to that session as supply; the id
   stays bound to that peer while its producer request lives, so later stores
   go straight to it.
2. Parked stores older than ``unbound_store_timeout_s`` fail and the id is
   tombstoned for ``tombstone_retention_s``: a fetch for it is rejected at once
   (the session finishes its supply, so the consumer hears ``transfer_done(false)``
   in one round trip), a store for it fails at once. Tombstones expire.
3. A fetch for an id with no producer state yet (decoder first) is remembered
   as an *early fetch* until the consumer's load would have timed out
   (``early_fetch_ttl_s``), so the producer request or stores that follow
   still bind to it - unless the fetch says the id's prefill leg already
   answered (``prefill_done``): then no producer request for it will ever come
   to this process (it restarted since, or forgot the id), and the fetch is
   rejected at once like a tombstoned one.
4. A binding with no live producer request completes the supply at once:
   nothing more will come for that id.
5. Nothing grows with the number of requests ever served: producer ids and
   bindings leave when the producer request finishes or the peer's session
   ends, everything else expires (oldest first: every work map is in age order).

Every method runs under the node's lock (it is called by the tier only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from kvpeer.node.counters import TierCounters
from kvpeer.session.worklist import WorkMap
from kvpeer.types import JobResult, TransferJob

__all__ = ["BindingStatistics", "Bindings", "Suppliers"]

log = logging.getLogger("kvpeer.tier")  # the tier's log: operators grep one name


class Suppliers(Protocol):
    """What the bindings need of the node's sessions (the peer table)."""

    def add_supply(self, peer_id: str, kv_request_id: str, job: TransferJob, now: float) -> bool:
        """Give ``job`` to the session toward ``peer_id`` as supply for the id;
        False when there is no such session or it did not take the job."""
        ...

    def finish_supply(self, peer_id: str, kv_request_id: str, now: float) -> None:
        """Tell the session toward ``peer_id`` (if any) that no more supply comes
        for the id."""
        ...

    def serves(self, peer_id: str) -> bool:
        """A live session toward ``peer_id`` exists."""
        ...


@dataclass(slots=True)
class _Parked:
    since: float
    jobs: list[TransferJob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BindingStatistics:
    producer_ids: int
    bound_ids: int
    parked_ids: int
    parked_batches: int
    tombstones: int
    early_fetches: int


class Bindings:
    """Parked supply, bindings, tombstones and early fetches of PD producer ids."""

    def __init__(
        self,
        suppliers: Suppliers,
        counters: TierCounters,
        *,
        unbound_store_timeout_s: float,
        tombstone_retention_s: float,
        early_fetch_ttl_s: float,
    ) -> None:
        self._suppliers = suppliers
        self._counters = counters
        self._unbound_timeout = unbound_store_timeout_s
        self._retention = tombstone_retention_s
        self._early_ttl = early_fetch_ttl_s
        self._producers: dict[str, str] = {}  # kv_request_id -> req_id
        self._bindings: dict[str, str] = {}  # kv_request_id -> peer_id
        self._parked: WorkMap[str, _Parked] = WorkMap()  # insertion order == age order
        self._tombstones: WorkMap[str, float] = WorkMap()  # id -> expiry, age order
        self._early_fetches: WorkMap[str, tuple[str, float]] = WorkMap()  # id -> (peer, expiry)

    # -- the producer request ---------------------------------------------------------

    def producer_started(self, kv_request_id: str, req_id: str, now: float) -> list[JobResult]:
        """A producer request for the id began; a fetch that came first binds now.
        Returns the jobs that failed on the way (a session refused them)."""
        self._producers[kv_request_id] = req_id
        return self._bind_early_fetch(kv_request_id, now)

    def producer_finished(self, kv_request_id: str, req_id: str, now: float) -> None:
        """The producer request ``req_id`` finished: its bound peer's supply is
        complete. Unbound, parked stores wait for the fetch; binding then sees no
        live producer and completes the supply (invariant 4)."""
        if self._producers.get(kv_request_id) == req_id:
            del self._producers[kv_request_id]
        peer_id = self._bindings.pop(kv_request_id, None)
        if peer_id is not None:
            self._suppliers.finish_supply(peer_id, kv_request_id, now)

    def store(self, kv_request_id: str, job: TransferJob, now: float) -> list[JobResult]:
        """A store of the id: supplied to its bound peer, or parked. Returns it
        failed at once if the id is tombstoned."""
        if kv_request_id in self._tombstones:
            return [JobResult(job.job_id, False)]
        peer_id = self._bindings.get(kv_request_id)
        if peer_id is not None and self._suppliers.add_supply(peer_id, kv_request_id, job, now):
            return []
        parked = self._parked.get(kv_request_id)
        if parked is None:
            parked = self._parked[kv_request_id] = _Parked(now)
        parked.jobs.append(job)
        return self._bind_early_fetch(kv_request_id, now)

    def tombstoned(self, kv_request_id: str) -> bool:
        return kv_request_id in self._tombstones

    # -- fetches ------------------------------------------------------------------------

    def fetched(
        self, kv_request_id: str, peer_id: str, now: float, *, prefill_done: bool = False
    ) -> list[JobResult]:
        """A fetch for the id arrived on ``peer_id``'s session: reject it if the id
        is tombstoned, bind it if the id has producer state, reject it if its
        prefill is done elsewhere (invariant 3), remember it otherwise.
        Returns the parked jobs that could not be supplied."""
        if kv_request_id in self._tombstones:
            self._reject_fetch(kv_request_id, peer_id, now, "stores were reaped")
            return []
        if kv_request_id in self._bindings:
            return []
        if kv_request_id in self._parked or kv_request_id in self._producers:
            return self._bind(kv_request_id, peer_id, now)
        if prefill_done:
            self._reject_fetch(
                kv_request_id, peer_id, now, "its prefill answered, but not from this process"
            )
            return []
        self._early_fetches.pop(kv_request_id, None)  # re-inserted: age order
        self._early_fetches[kv_request_id] = (peer_id, now + self._early_ttl)
        return []

    def _reject_fetch(self, kv_request_id: str, peer_id: str, now: float, why: str) -> None:
        self._counters.late_fetches_rejected += 1
        log.info("late fetch for %s from %s rejected (%s)", kv_request_id, peer_id, why)
        self._suppliers.finish_supply(peer_id, kv_request_id, now)

    def peer_gone(self, peer_id: str) -> None:
        """``peer_id``'s session ended: forget its bindings and early fetches."""
        for kv_request_id in [k for k, p in self._bindings.items() if p == peer_id]:
            del self._bindings[kv_request_id]
        for kv_request_id in [k for k, (p, _) in self._early_fetches.items() if p == peer_id]:
            del self._early_fetches[kv_request_id]

    def _bind_early_fetch(self, kv_request_id: str, now: float) -> list[JobResult]:
        early = self._early_fetches.pop(kv_request_id, None)
        if early is None or not self._suppliers.serves(early[0]):
            return []
        return self._bind(kv_request_id, early[0], now)

    def _bind(self, kv_request_id: str, peer_id: str, now: float) -> list[JobResult]:
        parked = self._parked.pop(kv_request_id, None)
        live = kv_request_id in self._producers
        if live:
            self._bindings[kv_request_id] = peer_id
        failed = []
        if parked is not None:
            for job in parked.jobs:
                if not self._suppliers.add_supply(peer_id, kv_request_id, job, now):
                    failed.append(JobResult(job.job_id, False))
        if not live:
            self._suppliers.finish_supply(peer_id, kv_request_id, now)
        return failed

    # -- time ---------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest parked-store timeout, tombstone or early-fetch expiry."""
        deadlines = []
        if (oldest := self._parked.first()) is not None:
            deadlines.append(oldest[1].since + self._unbound_timeout)
        if (tombstone := self._tombstones.first()) is not None:
            deadlines.append(tombstone[1])
        if (early := self._early_fetches.first()) is not None:
            deadlines.append(early[1][1])
        return min(deadlines, default=None)

    def expire(self, now: float) -> list[JobResult]:
        """Reap parked stores nobody fetched in time (tombstoning their ids), then
        drop tombstones and early fetches whose time is up. Returns the reaped
        stores, failed."""
        failed = self._reap_parked(now)
        while (tombstone := self._tombstones.first()) is not None:
            kv_request_id, expiry = tombstone
            if now < expiry:
                break
            del self._tombstones[kv_request_id]
        while (early := self._early_fetches.first()) is not None:
            kv_request_id, (_, expiry) = early
            if now < expiry:
                break
            del self._early_fetches[kv_request_id]
        return failed

    def _reap_parked(self, now: float) -> list[JobResult]:
        failed: list[JobResult] = []
        timeout = self._unbound_timeout
        while (oldest := self._parked.first()) is not None:
            kv_request_id, parked = oldest
            if now < parked.since + timeout:
                break
            del self._parked[kv_request_id]
            log.warning(
                "no fetch for %s within %gs: failing %d parked stores",
                kv_request_id,
                timeout,
                len(parked.jobs),
            )
            failed.extend(JobResult(job.job_id, False) for job in parked.jobs)
            self._counters.stores_reaped += len(parked.jobs)
            self._counters.timeouts["unbound_store"] += 1
            self._tombstones.pop(kv_request_id, None)
            self._tombstones[kv_request_id] = now + self._retention
        return failed

    def fail_parked(self) -> list[JobResult]:
        """Fail every parked store (the tier shuts down)."""
        failed = [JobResult(job.job_id, False) for p in self._parked.values() for job in p.jobs]
        self._parked.clear()
        return failed

    # -- statistics ---------------------------------------------------------------------

    def statistics(self) -> BindingStatistics:
        return BindingStatistics(
            producer_ids=len(self._producers),
            bound_ids=len(self._bindings),
            parked_ids=len(self._parked),
            parked_batches=sum(len(p.jobs) for p in self._parked.values()),
            tombstones=len(self._tombstones),
            early_fetches=len(self._early_fetches),
        )
