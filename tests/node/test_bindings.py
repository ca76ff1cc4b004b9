"""Producer bindings driven directly (``kvpeer.node.bindings`` invariants 1-5).

A fake :class:`Suppliers` stands for the peer table: it records what each
session was given and can refuse supply or have no session at all. Time is a
plain number. The end-to-end behaviour over real sessions is pinned by
``test_tier_producer.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvpeer.node.bindings import Bindings, BindingStatistics
from kvpeer.node.counters import TierCounters
from kvpeer.types import JobResult, RequestContext, TransferJob

UNBOUND_S = 60.0
RETENTION_S = 90.0
EARLY_S = 40.0


@dataclass
class FakeSuppliers:
    """Sessions by peer id: what each was supplied and which ids it saw complete."""

    live: set[str] = field(default_factory=lambda: {"c1", "c2"})
    refusing: set[str] = field(default_factory=set)
    supplied: list[tuple[str, str, int]] = field(default_factory=list)  # peer, id, job
    finished: list[tuple[str, str]] = field(default_factory=list)  # peer, id

    def add_supply(self, peer_id: str, kv_request_id: str, job: TransferJob, now: float) -> bool:
        if peer_id not in self.live or peer_id in self.refusing:
            return False
        self.supplied.append((peer_id, kv_request_id, job.job_id))
        return True

    def finish_supply(self, peer_id: str, kv_request_id: str, now: float) -> None:
        self.finished.append((peer_id, kv_request_id))

    def serves(self, peer_id: str) -> bool:
        return peer_id in self.live


@pytest.fixture
def peers() -> FakeSuppliers:
    return FakeSuppliers()


@pytest.fixture
def counters() -> TierCounters:
    return TierCounters()


@pytest.fixture
def bindings(peers: FakeSuppliers, counters: TierCounters) -> Bindings:
    return Bindings(
        peers,
        counters,
        unbound_store_timeout_s=UNBOUND_S,
        tombstone_retention_s=RETENTION_S,
        early_fetch_ttl_s=EARLY_S,
    )


def job(job_id: int) -> TransferJob:
    return TransferJob(job_id, (b"k%d" % job_id,), (job_id,), RequestContext("p", None))


def failed(*job_ids: int) -> list[JobResult]:
    return [JobResult(j, False) for j in job_ids]


def nothing_held(bindings: Bindings) -> bool:
    return bindings.statistics() == BindingStatistics(0, 0, 0, 0, 0, 0)


class TestParking:
    """Invariants 1 and 4: stores wait for the fetch; either may come first."""

    def test_stores_park_until_a_fetch_binds_them(
        self, bindings: Bindings, peers: FakeSuppliers
    ) -> None:
        assert bindings.producer_started("kv", "p", 0.0) == []
        assert bindings.store("kv", job(1), 0.0) == []
        assert bindings.store("kv", job(2), 1.0) == []
        assert peers.supplied == []
        assert bindings.statistics().parked_batches == 2
        assert bindings.fetched("kv", "c1", 2.0) == []
        assert peers.supplied == [("c1", "kv", 1), ("c1", "kv", 2)]
        stats = bindings.statistics()
        assert (stats.bound_ids, stats.parked_ids) == (1, 0)
        assert peers.finished == []  # the producer still runs: more may come

    def test_a_bound_id_supplies_later_stores_at_once(
        self, bindings: Bindings, peers: FakeSuppliers
    ) -> None:
        bindings.producer_started("kv", "p", 0.0)
        bindings.fetched("kv", "c1", 0.0)
        assert bindings.store("kv", job(1), 1.0) == []
        assert peers.supplied == [("c1", "kv", 1)]
        assert bindings.statistics().parked_ids == 0

    def test_a_second_fetch_of_a_bound_id_changes_nothing(
        self, bindings: Bindings, peers: FakeSuppliers
    ) -> None:
        bindings.producer_started("kv", "p", 0.0)
        bindings.fetched("kv", "c1", 0.0)
        assert bindings.fetched("kv", "c2", 1.0) == []
        bindings.store("kv", job(1), 1.0)
        assert peers.supplied == [("c1", "kv", 1)]

    def test_binding_after_the_producer_finished_completes_the_supply(
        self, bindings: Bindings, peers: FakeSuppliers
    ) -> None:
        bindings.producer_started("kv", "p", 0.0)
        bindings.store("kv", job(1), 0.0)
        bindings.producer_finished("kv", "p", 1.0)
        assert peers.finished == []  # unbound: nobody to tell yet
        bindings.fetched("kv", "c1", 2.0)
        assert peers.supplied == [("c1", "kv", 1)]
        assert peers.finished == [("c1", "kv")]
        assert nothing_held(bindings)

    def test_the_producer_finishing_completes_a_bound_supply(
        self, bindings: Bindings, peers: FakeSuppliers
    ) -> None:
        bindings.producer_started("kv", "p", 0.0)
        bindings.fetched("kv", "c1", 0.0)
        bindings.producer_finished("kv", "p", 1.0)
        assert peers.finished == [("c1", "kv")]
        assert nothing_held(bindings)

    def test_another_request_finishing_leaves_the_producer_alone(
        self, bindings: Bindings, peers: FakeSuppliers
    ) -> None:
        bindings.producer_started("kv", "p2", 0.0)  # p2 took the id over
        bindings.producer_finished("kv", "p1", 1.0)
        assert bindings.statistics().producer_ids == 1

    def test_supply_a_session_refuses_fails(self, bindings: Bindings, peers: FakeSuppliers) -> None:
        bindings.producer_started("kv", "p", 0.0)
        bindings.store("kv", job(1), 0.0)
        peers.refusing.add("c1")
        assert bindings.fetched("kv", "c1", 1.0) == failed(1)

    def test_a_store_its_bound_session_refuses_parks_again(
        self, bindings: Bindings, peers: FakeSuppliers
    ) -> None:
        bindings.producer_started("kv", "p", 0.0)
        bindings.fetched("kv", "c1", 0.0)
        peers.refusing.add("c1")
        assert bindings.store("kv", job(1), 1.0) == []
        assert bindings.statistics().parked_batches == 1

    def test_a_gone_peer_loses_its_bindings(self, bindings: Bindings, peers: FakeSuppliers) -> None:
        bindings.producer_started("kv", "p", 0.0)
        bindings.fetched("kv", "c1", 0.0)
        bindings.peer_gone("c1")
        assert bindings.statistics().bound_ids == 0
        bindings.store("kv", job(1), 1.0)
        assert bindings.statistics().parked_ids == 1  # waits for the next fetch
        bindings.fetched("kv", "c2", 2.0)
        assert peers.supplied == [("c2", "kv", 1)]


class TestEarlyFetches:
    """Invariant 3: a fetch before the producer is remembered, for a while."""

    def test_the_producer_request_binds_an_early_fetch(
        self, bindings: Bindings, peers: FakeSuppliers
    ) -> None:
        assert bindings.fetched("kv", "c1", 0.0) == []
        assert bindings.statistics().early_fetches == 1
        bindings.producer_started("kv", "p", 1.0)
        assert bindings.statistics().early_fetches == 0
        assert bindings.statistics().bound_ids == 1
        bindings.store("kv", job(1), 2.0)
        assert peers.supplied == [("c1", "kv", 1)]

    def test_a_store_binds_an_early_fetch(self, bindings: Bindings, peers: FakeSuppliers) -> None:
        bindings.fetched("kv", "c1", 0.0)
        assert bindings.store("kv", job(1), 1.0) == []
        assert peers.supplied == [("c1", "kv", 1)]
        assert peers.finished == [("c1", "kv")]  # no producer request: nothing more comes

    def test_an_early_fetch_of_a_dead_session_is_dropped(
        self, bindings: Bindings, peers: FakeSuppliers
    ) -> None:
        bindings.fetched("kv", "c1", 0.0)
        peers.live.discard("c1")
        bindings.producer_started("kv", "p", 1.0)
        stats = bindings.statistics()
        assert (stats.early_fetches, stats.bound_ids) == (0, 0)

    def test_a_gone_peer_loses_its_early_fetches(self, bindings: Bindings) -> None:
        bindings.fetched("kv1", "c1", 0.0)
        bindings.fetched("kv2", "c2", 0.0)
        bindings.peer_gone("c1")
        assert bindings.statistics().early_fetches == 1

    def test_early_fetches_expire(self, bindings: Bindings, peers: FakeSuppliers) -> None:
        bindings.fetched("kv", "c1", 0.0)
        assert bindings.next_deadline() == EARLY_S
        assert bindings.expire(EARLY_S - 0.1) == []
        assert bindings.statistics().early_fetches == 1
        bindings.expire(EARLY_S)
        assert nothing_held(bindings)
        bindings.producer_started("kv", "p", EARLY_S + 1)
        assert bindings.statistics().bound_ids == 0

    def test_a_repeated_early_fetch_starts_its_time_again(self, bindings: Bindings) -> None:
        bindings.fetched("kv1", "c1", 0.0)
        bindings.fetched("kv2", "c1", 5.0)
        bindings.fetched("kv1", "c2", 10.0)  # now the youngest
        assert bindings.next_deadline() == 5.0 + EARLY_S
        bindings.expire(5.0 + EARLY_S)
        assert bindings.statistics().early_fetches == 1
        assert bindings.next_deadline() == 10.0 + EARLY_S


class TestTombstones:
    """Invariant 2: unfetched stores fail, and the id is refused for a while."""

    def test_parked_stores_fail_after_the_unbound_timeout(
        self, bindings: Bindings, counters: TierCounters
    ) -> None:
        bindings.producer_started("kv", "p", 0.0)
        bindings.store("kv", job(1), 0.0)
        bindings.store("kv", job(2), 30.0)  # same batch: its age is the first store's
        assert bindings.next_deadline() == UNBOUND_S
        assert bindings.expire(UNBOUND_S - 0.1) == []
        assert bindings.expire(UNBOUND_S) == failed(1, 2)
        assert counters.stores_reaped == 2
        assert counters.timeouts["unbound_store"] == 1
        assert bindings.statistics().tombstones == 1
        assert bindings.tombstoned("kv")

    def test_only_the_timed_out_ids_are_reaped(self, bindings: Bindings) -> None:
        bindings.store("kv1", job(1), 0.0)
        bindings.store("kv2", job(2), 10.0)
        assert bindings.expire(UNBOUND_S) == failed(1)
        assert bindings.statistics().parked_ids == 1
        assert bindings.next_deadline() == 10.0 + UNBOUND_S

    def test_a_fetch_for_a_tombstoned_id_is_rejected(
        self, bindings: Bindings, peers: FakeSuppliers, counters: TierCounters
    ) -> None:
        bindings.store("kv", job(1), 0.0)
        bindings.expire(UNBOUND_S)
        assert bindings.fetched("kv", "c1", UNBOUND_S + 1) == []
        assert peers.finished == [("c1", "kv")]  # the session answers transfer_done(false)
        assert counters.late_fetches_rejected == 1
        assert bindings.statistics().early_fetches == 0

    def test_a_store_for_a_tombstoned_id_fails_at_once(self, bindings: Bindings) -> None:
        bindings.store("kv", job(1), 0.0)
        bindings.expire(UNBOUND_S)
        assert bindings.store("kv", job(2), UNBOUND_S + 1) == failed(2)
        assert bindings.statistics().parked_ids == 0

    def test_tombstones_expire(self, bindings: Bindings, peers: FakeSuppliers) -> None:
        bindings.store("kv", job(1), 0.0)
        bindings.expire(UNBOUND_S)
        assert bindings.next_deadline() == UNBOUND_S + RETENTION_S
        bindings.expire(UNBOUND_S + RETENTION_S - 0.1)
        assert bindings.tombstoned("kv")
        bindings.expire(UNBOUND_S + RETENTION_S)
        assert nothing_held(bindings)
        assert bindings.next_deadline() is None
        # The id is usable again: a new store parks, a fetch binds it.
        bindings.store("kv", job(2), 200.0)
        bindings.fetched("kv", "c1", 201.0)
        assert peers.supplied == [("c1", "kv", 2)]


def test_shutdown_fails_every_parked_store(bindings: Bindings) -> None:
    bindings.store("kv1", job(1), 0.0)
    bindings.store("kv1", job(2), 0.0)
    bindings.store("kv2", job(3), 0.0)
    assert bindings.fail_parked() == failed(1, 2, 3)
    assert bindings.statistics().parked_ids == 0
    assert bindings.fail_parked() == []


def test_many_ids_leave_nothing_behind(bindings: Bindings, peers: FakeSuppliers) -> None:
    """Invariant 5: every path out of the bindings drops what it held."""
    for n in range(300):
        kv, now = f"kv{n}", float(n)
        if n % 3 == 0:  # PD, stores first
            bindings.producer_started(kv, "p", now)
            bindings.store(kv, job(n), now)
            bindings.fetched(kv, "c1", now)
        elif n % 3 == 1:  # decoder first
            bindings.fetched(kv, "c2", now)
            bindings.producer_started(kv, "p", now)
            bindings.store(kv, job(n), now)
        else:  # nobody ever fetches
            bindings.producer_started(kv, "p", now)
            bindings.store(kv, job(n), now)
        bindings.producer_finished(kv, "p", now)
    assert bindings.statistics().tombstones == 0  # a tombstone only once reaped
    reaped = bindings.expire(300 + UNBOUND_S)
    assert len(reaped) == 100
    bindings.expire(300 + UNBOUND_S + RETENTION_S)
    assert nothing_held(bindings)
