"""Producer role: supply, demand and round isolation (docs/design.md §5.1, §5.3, §5.4, §5.7).

Node ``b`` is the producer, node ``a`` the consumer. Mirrors vLLM's
TestServerFlows / TestFinishRequestServerSide scenarios and the round
isolation regressions of seed 000 (vLLM issue #49820). Every flow ends with
nothing open on the producer's parent; the harness asserts that every store
job is reported exactly once.
"""

from __future__ import annotations

import pytest

from kvpeer.protocol import (
    AbortAck,
    AbortFetch,
    Fetch,
    Lookup,
    LookupResponse,
    TransferDone,
)
from kvpeer.session import SessionSettings
from kvpeer.testing import Node, SessionPair
from kvpeer.testing.steps import inject, sent
from kvpeer.types import Key, StoreJob

KV = "req-1"
K1, K2, K3 = b"key-1", b"key-2", b"key-3"


# -- helpers -------------------------------------------------------------------


def supply(pair: SessionPair, keys: list[Key]) -> StoreJob:
    """The producer's host stores ``keys`` for a PD request and binds them here."""
    for key in keys:
        pair.b.parent.put(key)
    job = pair.b.parent.store_job(keys)
    assert pair.b.session.add_supply(KV, job, pair.clock.now)
    return job


def probe(pair: SessionPair, keys: list[Key]) -> None:
    """A symmetric lookup round trip: probes out, one serve window, answers back."""
    for key in keys:
        assert pair.a.session.register_probe(KV, key, pair.clock.now) is None
    pair.a.session.flush_lookups()
    pair.deliver()
    pair.serve()
    pair.pump()


def fetch(pair: SessionPair, keys: list[Key], first_slot: int = 10, *, pump: bool = True) -> int:
    """The consumer loads ``keys`` into consecutive slots; returns the load job id."""
    job_id = pair.next_job_id()
    slots = list(range(first_slot, first_slot + len(keys)))
    pair.a.session.request_blocks(job_id, KV, keys, slots, pair.clock.now)
    if pump:
        pair.pump()
    return job_id



def crafted_fetch(pair: SessionPair, round_seq: int, keys: list[Key], first_slot: int) -> None:
    """A fetch with an explicit round, sent as a consumer would (slots opened first)."""
    slots = tuple(range(first_slot, first_slot + len(keys)))
    pair.a.plane.expect_writes("b", slots)
    fetch = Fetch(kv_request_id=KV, keys=tuple(keys), block_indexes=slots, round_seq=round_seq)
    inject(pair, pair.b, fetch)



def done(node: Node) -> list[tuple[int, bool]]:
    return [(m.round_seq, m.success) for m in node.sent() if isinstance(m, TransferDone)]


def failure_reasons(node: Node) -> list[str | None]:
    return [m.reason for m in node.sent() if isinstance(m, TransferDone) and not m.success]


def acks(node: Node) -> list[tuple[str, int]]:
    return [(m.kv_request_id, m.round_seq) for m in node.sent() if isinstance(m, AbortAck)]


def write_into(node: Node, slot: int) -> int:
    """The id of the pending write whose first remote slot is ``slot``."""
    [tid] = [t for t, w in node.plane.pending.items() if w.remote_slots[0] == slot]
    return tid


def assert_settled(pair: SessionPair) -> None:
    """Nothing is left pinned, open or in flight on the producer."""
    assert pair.b.parent.open_jobs == {}
    assert pair.b.parent.pinned_slots() == 0
    assert pair.b.parent.open_requests == {}
    assert pair.b.plane.pending == {}
    assert pair.b.plane.violations == []
    assert pair.b.closed is None
    stats = pair.b.session.statistics().producer
    assert (stats.store_jobs_open, stats.transfers_in_flight, stats.rounds_draining) == (0, 0, 0)


def assert_loaded(pair: SessionPair, keys: list[Key], first_slot: int) -> None:
    for i, key in enumerate(keys):
        assert pair.a.region.block(first_slot + i) == pair.b.parent.expected(key)


# -- PD ----------------------------------------------------------------------


class TestPDMatching:
    @pytest.mark.parametrize("store_first", [True, False], ids=["store-fetch", "fetch-store"])
    def test_store_and_fetch_match_in_either_order(self, store_first: bool) -> None:
        """Parked stores and parked demand meet; the blocks land in the fetch's slots."""
        pair = SessionPair()
        if store_first:
            job = supply(pair, [K1, K2])
            load = fetch(pair, [K1, K2])
        else:
            load = fetch(pair, [K1, K2])
            assert (pair.b.plane.pending, done(pair.b)) == ({}, [])
            job = supply(pair, [K1, K2])
        [write] = pair.b.plane.pending.values()
        assert (write.local_slots, write.remote_slots) == (job.slots, (10, 11))
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(0, True)]
        assert pair.a.loads[load].success
        assert pair.b.stores[job.job_id].success
        assert_loaded(pair, [K1, K2], 10)
        assert_settled(pair)

    def test_partly_supplied_fetch_completes_when_the_rest_arrives(self) -> None:
        """Supply in two batches: the round ends only after the last block lands."""
        pair = SessionPair()
        load = fetch(pair, [K1, K2, K3])
        first = supply(pair, [K1])
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == []
        assert pair.b.stores[first.job_id].success
        assert load not in pair.a.loads

        second = supply(pair, [K2, K3])
        pair.b.plane.complete_all()
        pair.pump()
        [message] = [m for m in pair.b.sent() if isinstance(m, TransferDone)]
        assert (message.success, message.round_seq, message.blocks) == (True, 0, 3)
        assert pair.b.stores[second.job_id].success
        assert pair.a.loads[load].success
        assert_loaded(pair, [K1, K2, K3], 10)
        assert_settled(pair)

    def test_pool_supply_serves_a_second_round(self) -> None:
        """One PD store serves round 1 after round 0 finished, each with its own transfer_done."""
        pair = SessionPair()
        job = supply(pair, [K1, K2])
        load0 = fetch(pair, [K1], 10)
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(0, True)]
        assert pair.a.loads[load0].success
        assert job.job_id not in pair.b.stores  # K2 still serves

        crafted_fetch(pair, 1, [K2], 20)
        assert len(pair.b.plane.pending) == 1  # matched at once, no waiting
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(0, True), (1, True)]
        assert pair.b.stores[job.job_id].success
        assert_loaded(pair, [K1], 10)
        assert_loaded(pair, [K2], 20)
        assert_settled(pair)


class TestPDFinishSupply:
    def test_unmet_demand_fails_at_once_when_the_producer_request_finishes(self) -> None:
        """finish_supply with nothing in flight answers transfer_done(false) immediately."""
        pair = SessionPair()
        job = supply(pair, [K1])
        load = fetch(pair, [K1, K2])
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == []

        pair.b.session.finish_supply(KV, pair.clock.now)
        assert done(pair.b) == [(0, False)]
        [reason] = failure_reasons(pair.b)
        assert reason
        pair.pump()
        assert not pair.a.loads[load].success
        assert pair.b.stores[job.job_id].success  # its block was written
        assert_settled(pair)

    def test_finish_before_fetch_with_full_supply_succeeds(self) -> None:
        """Prefiller first: a later fetch of only supplied keys still succeeds."""
        pair = SessionPair()
        job = supply(pair, [K1, K2])
        pair.b.session.finish_supply(KV, pair.clock.now)
        load = fetch(pair, [K1, K2])
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(0, True)]
        assert pair.a.loads[load].success
        assert pair.b.stores[job.job_id].success
        assert_settled(pair)

    def test_finish_before_fetch_with_partial_supply_fails_at_once(self) -> None:
        """Prefiller first: a fetch wanting more than was stored fails on arrival."""
        pair = SessionPair()
        job = supply(pair, [K1])
        pair.b.session.finish_supply(KV, pair.clock.now)
        load = fetch(pair, [K1, K2], pump=False)
        pair.deliver()
        assert done(pair.b) == [(0, False)]
        assert pair.b.plane.pending == {}  # nothing can still land in the consumer's slots
        pair.pump()
        assert not pair.a.loads[load].success
        assert job.job_id in pair.b.stores
        assert_settled(pair)


# -- symmetric ------------------------------------------------------------------


class TestSymmetricFetch:
    def test_fetch_writes_the_pinned_slots(self) -> None:
        """A fetch of looked-up keys writes the pinned slots; the pin job succeeds."""
        pair = SessionPair()
        pair.b.parent.put(K1)
        pair.b.parent.put(K2)
        probe(pair, [K1, K2])
        [pin] = pair.b.parent.open_jobs.values()
        load = fetch(pair, [K1, K2])
        [write] = pair.b.plane.pending.values()
        assert (write.local_slots, write.remote_slots) == (pin.slots, (10, 11))
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(0, True)]
        assert pair.b.stores[pin.job_id].success
        assert pair.a.loads[load].success
        assert_loaded(pair, [K1, K2], 10)
        assert_settled(pair)

    def test_fetch_of_an_unpinned_key_fails_fast(self) -> None:
        """A symmetric fetch wanting a key nobody pinned fails at once and unpins the round."""
        pair = SessionPair()
        pair.b.parent.put(K1)
        probe(pair, [K1, K2])
        [pin] = pair.b.parent.open_jobs.values()
        crafted = Fetch(kv_request_id=KV, keys=(K1, K2), block_indexes=(10, 11), round_seq=0)
        inject(pair, pair.b, crafted)
        assert done(pair.b) == [(0, False)]
        assert pair.b.plane.pending == {}
        pair.pump()
        assert not pair.b.stores[pin.job_id].success
        stats = pair.b.session.statistics().producer
        assert (stats.rounds, stats.pinned_blocks) == (0, 0)
        pair.a.session.finish_consumer(KV, pair.clock.now)
        pair.pump()
        assert_settled(pair)


# -- rounds ----------------------------------------------------------------------


class TestRoundIsolation:
    def test_completing_round_0_keeps_round_1_supply(self) -> None:
        """Round 0 finishing leaves the pins of round 1's lookup alone."""
        pair = SessionPair()
        pair.b.parent.put(K1)
        slot2 = pair.b.parent.put(K2)
        probe(pair, [K1])
        load0 = fetch(pair, [K1], 10)
        probe(pair, [K2])  # round 1
        [pin1] = [j for j in pair.b.parent.open_jobs.values() if j.keys == (K2,)]

        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(0, True)]
        assert pair.b.parent.pins == {slot2: 1}
        assert pin1.job_id not in pair.b.stores
        stats = pair.b.session.statistics().producer
        assert (stats.rounds, stats.pinned_blocks) == (1, 1)

        load1 = fetch(pair, [K2], 20)
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(0, True), (1, True)]
        assert pair.a.loads[load0].success
        assert pair.a.loads[load1].success
        assert pair.b.stores[pin1.job_id].success
        assert_loaded(pair, [K2], 20)
        assert_settled(pair)

    def test_round_1_served_after_round_0_finalises(self) -> None:
        """A full second lookup→fetch cycle after round 0 ended gets its own transfer_done."""
        pair = SessionPair()
        pair.b.parent.put(K1)
        pair.b.parent.put(K2)
        inject(pair, pair.b, Lookup(kv_request_id=KV, keys=(K1,), round_seq=0))
        pair.serve()
        crafted_fetch(pair, 0, [K1], 10)
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(0, True)]

        inject(pair, pair.b, Lookup(kv_request_id=KV, keys=(K2,), round_seq=1))
        pair.serve()
        crafted_fetch(pair, 1, [K2], 20)
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(0, True), (1, True)]
        answers = [(r.round_seq, r.hits) for r in sent(pair.b, LookupResponse)]
        assert answers == [(0, (True,)), (1, (True,))]
        assert_loaded(pair, [K1], 10)
        assert_loaded(pair, [K2], 20)
        assert_settled(pair)

    def test_terminal_empty_fetch_leaves_no_zombie_round(self) -> None:
        """The terminal fetch unpins, sends nothing and leaves no state; the id is reusable."""
        pair = SessionPair()
        pair.b.parent.put(K1)
        probe(pair, [K1])
        [pin] = pair.b.parent.open_jobs.values()
        pair.a.session.finish_consumer(KV, pair.clock.now)
        pair.pump()
        assert done(pair.b) == []
        assert pin.job_id in pair.b.stores
        stats = pair.b.session.statistics().producer
        assert (stats.rounds, stats.pinned_blocks, stats.requests) == (0, 0, 0)
        assert_settled(pair)

        probe(pair, [K1])  # the same id again: not a duplicate round
        load = fetch(pair, [K1])
        pair.b.plane.complete_all()
        pair.pump()
        assert pair.b.closed is None
        assert done(pair.b) == [(0, True)]
        assert pair.a.loads[load].success
        assert_settled(pair)

    def test_abort_of_round_0_keeps_round_1_supply(self) -> None:
        """Aborting round 0 leaves round 1's pins; round 1 still succeeds."""
        pair = SessionPair(settings=SessionSettings(load_timeout_s=1.0))
        pair.b.parent.put(K1)
        slot2 = pair.b.parent.put(K2)
        probe(pair, [K1])
        load0 = fetch(pair, [K1], 10)
        probe(pair, [K2])
        pair.advance(1.0)
        pair.pump()  # the consumer aborts round 0, the producer acks it
        assert acks(pair.b) == [(KV, 0)]
        assert not pair.a.loads[load0].success
        assert pair.b.parent.pins == {slot2: 1}

        load1 = fetch(pair, [K2], 20)
        pair.b.plane.complete_all()
        pair.pump()
        assert done(pair.b) == [(1, True)]
        assert pair.a.loads[load1].success
        assert_loaded(pair, [K2], 20)
        assert_settled(pair)

    def test_concurrent_rounds_complete_out_of_order(self) -> None:
        """Two rounds in flight: each completes on its own, tagged with its round."""
        pair = SessionPair()
        pair.b.parent.put(K1)
        pair.b.parent.put(K2)
        probe(pair, [K1])
        load0 = fetch(pair, [K1], 10)
        probe(pair, [K2])
        load1 = fetch(pair, [K2], 20)
        assert len(pair.b.plane.pending) == 2

        pair.b.plane.complete(write_into(pair.b, 20))
        pair.pump()
        assert done(pair.b) == [(1, True)]
        assert pair.a.loads[load1].success
        assert load0 not in pair.a.loads

        pair.b.plane.complete(write_into(pair.b, 10))
        pair.pump()
        assert done(pair.b) == [(1, True), (0, True)]
        assert pair.a.loads[load0].success
        assert_loaded(pair, [K1], 10)
        assert_loaded(pair, [K2], 20)
        assert_settled(pair)


# -- abort -----------------------------------------------------------------------


class TestAbort:
    def test_abort_with_nothing_in_flight_acks_at_once(self) -> None:
        """A round with no write in flight is acked as soon as the abort arrives."""
        pair = SessionPair(settings=SessionSettings(load_timeout_s=1.0))
        load = fetch(pair, [K1])  # PD demand that no store meets
        pair.advance(1.0)
        pair.poll()
        pair.deliver()
        assert acks(pair.b) == [(KV, 0)]
        assert done(pair.b) == []
        pair.pump()
        assert not pair.a.loads[load].success
        assert pair.b.session.statistics().producer.rounds == 0
        assert_settled(pair)

    @pytest.mark.parametrize("ending", ["complete", "fail", "drain_timeout"])
    def test_abort_waits_for_a_busy_write(self, ending: str) -> None:
        """A write a wait-cancel cannot release delays the ack until it ends or the drain ends."""
        settings = SessionSettings(load_timeout_s=1.0)
        pair = SessionPair(settings=settings)
        job = supply(pair, [K1])
        load = fetch(pair, [K1])
        [tid] = pair.b.plane.pending
        pair.b.plane.pending[tid].busy = True
        pair.advance(1.0)
        pair.pump()
        assert acks(pair.b) == []
        assert pair.b.session.statistics().producer.rounds_draining == 1

        if ending == "complete":
            pair.b.plane.complete(tid)
        elif ending == "fail":
            pair.b.plane.fail(tid)
        else:
            pair.advance(settings.abort_drain_timeout_s - 0.5)
            pair.pump()
            assert acks(pair.b) == []
            pair.advance(0.5)
        pair.pump()
        assert acks(pair.b) == [(KV, 0)]
        assert done(pair.b) == []
        if ending == "drain_timeout":
            assert tid in pair.b.plane.cancelled
        assert not pair.a.loads[load].success
        assert job.job_id in pair.b.stores
        pair.advance(settings.abort_drain_timeout_s)
        pair.pump()
        assert acks(pair.b) == [(KV, 0)]
        assert_settled(pair)

    def test_duplicate_abort_keeps_the_drain_deadline(self) -> None:
        """A second abort while draining neither acks twice nor extends the deadline."""
        pair = SessionPair()
        drain = pair.settings.abort_drain_timeout_s
        supply(pair, [K1])
        fetch(pair, [K1])
        [tid] = pair.b.plane.pending
        pair.b.plane.pending[tid].busy = True
        abort = AbortFetch(kv_request_id=KV, round_seq=0)
        inject(pair, pair.b, abort)
        pair.advance(drain / 2)
        inject(pair, pair.b, abort)
        pair.pump()
        assert acks(pair.b) == []

        pair.advance(drain / 2 - 0.5)
        pair.pump()
        assert acks(pair.b) == []
        pair.advance(0.5)  # the first abort's deadline
        pair.pump()
        assert acks(pair.b) == [(KV, 0)]
        pair.advance(drain)
        pair.pump()
        assert acks(pair.b) == [(KV, 0)]
        assert_settled(pair)

    def test_abort_for_an_unknown_round_is_acked(self) -> None:
        """Nothing of an unknown round can touch the consumer: ack at once."""
        pair = SessionPair()
        inject(pair, pair.b, AbortFetch(kv_request_id="ghost", round_seq=7))
        assert acks(pair.b) == [("ghost", 7)]
        pair.pump()
        assert_settled(pair)


# -- transfer failures -------------------------------------------------------------


class TestTransferFailures:
    def test_write_that_cannot_start_fails_the_round_at_once(self) -> None:
        """write_blocks raising: transfer_done(false) on arrival, the supply job fails."""
        pair = SessionPair()
        job = supply(pair, [K1, K2])
        pair.b.plane.fail_next_writes = 1
        load = fetch(pair, [K1, K2], pump=False)
        pair.deliver()
        assert done(pair.b) == [(0, False)]
        [reason] = failure_reasons(pair.b)
        assert reason
        pair.pump()
        assert not pair.b.stores[job.job_id].success
        assert not pair.a.loads[load].success
        assert_settled(pair)

    def test_write_failing_later_fails_the_round(self) -> None:
        """A write reported failed by the data plane ends the round with transfer_done(false)."""
        pair = SessionPair()
        job = supply(pair, [K1])
        load = fetch(pair, [K1])
        [tid] = pair.b.plane.pending
        pair.b.plane.fail(tid)
        pair.pump()
        assert done(pair.b) == [(0, False)]
        assert not pair.b.stores[job.job_id].success
        assert not pair.a.loads[load].success
        assert_settled(pair)

    def test_failed_round_waits_for_a_busy_sibling_write(self) -> None:
        """transfer_done(false) goes out only once the round's other write stopped."""
        pair = SessionPair()
        load = fetch(pair, [K1, K2])
        first = supply(pair, [K1])
        second = supply(pair, [K2])
        t1, t2 = sorted(pair.b.plane.pending)
        pair.b.plane.pending[t2].busy = True
        pair.b.plane.fail(t1)
        pair.pump()
        assert done(pair.b) == []
        assert load not in pair.a.loads

        pair.b.plane.complete(t2)
        pair.pump()
        assert done(pair.b) == [(0, False)]
        assert not pair.b.stores[first.job_id].success
        assert second.job_id in pair.b.stores
        assert not pair.a.loads[load].success
        assert_settled(pair)

    def test_write_running_past_the_transfer_timeout_fails_its_round(self) -> None:
        """A stalled write (the consumer stopped reading) does not pin blocks forever:
        past transfer_timeout_s the round fails, drains, and its pins are released."""
        pair = SessionPair(settings=SessionSettings(peer_wait_s=1e6))  # a stalled consumer
        job = supply(pair, [K1])
        fetch(pair, [K1])
        [tid] = pair.b.plane.pending
        pair.b.plane.pending[tid].busy = True  # never finishes, cannot be released
        limit = pair.settings.transfer_timeout_s
        assert pair.b.session.next_deadline() is not None
        pair.clock.advance(limit - 1)
        pair.b.record(pair.b.session.poll(pair.clock.now))
        assert done(pair.b) == []
        pair.clock.advance(1)
        pair.b.record(pair.b.session.poll(pair.clock.now))  # round fails, drain starts
        assert done(pair.b) == []
        pair.clock.advance(pair.settings.abort_drain_timeout_s)
        pair.b.record(pair.b.session.poll(pair.clock.now))  # abandoned after the drain
        assert done(pair.b) == [(0, False)]
        assert not pair.b.stores[job.job_id].success
        assert pair.b.parent.pinned_slots() == 0


# -- store timeout -----------------------------------------------------------------


class TestStoreTimeout:
    def test_unfetched_lookup_pin_times_out_once(self) -> None:
        """A lookup pin nobody fetches fails after store_timeout_s, exactly once."""
        pair = SessionPair()
        timeout = pair.settings.store_timeout_s
        pair.b.parent.put(K1)
        probe(pair, [K1])
        [pin] = pair.b.parent.open_jobs.values()
        pair.advance(timeout - 0.5)
        pair.pump()
        assert pin.job_id not in pair.b.stores
        pair.advance(0.5)
        pair.pump()
        assert not pair.b.stores[pin.job_id].success
        assert pair.b.parent.pinned_slots() == 0
        assert pair.b.session.statistics().producer.pinned_blocks == 0
        pair.advance(timeout)
        pair.pump()
        pair.a.session.finish_consumer(KV, pair.clock.now)
        pair.pump()
        assert_settled(pair)

    def test_unfetched_pool_supply_times_out_once(self) -> None:
        """A PD store nobody fetches fails after store_timeout_s, exactly once."""
        pair = SessionPair()
        timeout = pair.settings.store_timeout_s
        job = supply(pair, [K1, K2])
        pair.advance(timeout - 0.5)
        pair.pump()
        assert job.job_id not in pair.b.stores
        pair.advance(0.5)
        pair.pump()
        assert not pair.b.stores[job.job_id].success
        pair.advance(timeout)
        pair.pump()
        assert pair.b.session.statistics().producer.requests == 0
        assert_settled(pair)

    @pytest.mark.parametrize("late", ["complete", "fail"])
    def test_timeout_racing_a_partly_in_flight_job_reports_once(self, late: str) -> None:
        """Timeout with one key in flight: the job is reported once, when the write ends."""
        pair = SessionPair(settings=SessionSettings(store_timeout_s=5.0))
        job = supply(pair, [K1, K2])
        load = fetch(pair, [K1])
        [tid] = pair.b.plane.pending
        pair.advance(5.0)
        pair.pump()
        assert job.job_id not in pair.b.stores  # K1 is still being written
        assert pair.b.session.statistics().producer.pinned_blocks == 0

        if late == "complete":
            pair.b.plane.complete(tid)
        else:
            pair.b.plane.fail(tid)
        pair.pump()
        assert not pair.b.stores[job.job_id].success  # K2 timed out
        assert done(pair.b) == [(0, late == "complete")]
        assert pair.a.loads[load].success is (late == "complete")
        pair.advance(5.0)
        pair.pump()
        assert_settled(pair)

    def test_timeout_of_a_fully_in_flight_job_waits_for_the_write(self) -> None:
        """Timeout with every key in flight: the late completion reports success once."""
        pair = SessionPair(settings=SessionSettings(store_timeout_s=5.0))
        job = supply(pair, [K1])
        load = fetch(pair, [K1])
        pair.advance(5.0)
        pair.pump()
        assert job.job_id not in pair.b.stores
        pair.b.plane.complete_all()
        pair.pump()
        assert pair.b.stores[job.job_id].success
        assert pair.a.loads[load].success
        pair.advance(5.0)
        pair.pump()
        assert_settled(pair)
