"""Consumer role, load phase: fetch rounds, completion, timeouts, finish and close.

Node ``a`` is the consumer and node ``b`` the producer. Pins consumer invariants
5-7 (docs/design.md §5.2-§5.4, §5.7, §5.8; vLLM TestClientFlows / TestLookupFlow).
Hand-made producer messages are delivered straight to ``a`` after the handshake.
"""

from __future__ import annotations

from typing import TypeVar

import pytest

from kvpeer.errors import ProtocolError
from kvpeer.protocol import (
    AbortAck,
    AbortFetch,
    Fetch,
    LookupResponse,
    Message,
    TransferDone,
)
from kvpeer.session import CloseKind, SessionSettings
from kvpeer.testing import Node, SessionPair
from kvpeer.testing.steps import fetch, inject, probe, sent, serve_lookups
from kvpeer.types import Key

ID = "req-1"
M = TypeVar("M", bound=Message)

#: A peer that never answers, but is not given up for silence (invariant 4 of
#: ``kvpeer.session.peer``): these tests are about the load and abort timers.
PATIENT = SessionSettings(peer_wait_s=1e6)


def key(n: int) -> Key:
    """A block key: a prefix-hash stand-in followed by a 4-byte group index."""
    return f"prefix-hash-{n:04d}".encode() + (0).to_bytes(4, "big")







def done(round_seq: int, success: bool = True, reason: str | None = None) -> TransferDone:
    return TransferDone(kv_request_id=ID, success=success, round_seq=round_seq, reason=reason)


def terminal_fetches(node: Node) -> list[Fetch]:
    return [m for m in sent(node, Fetch) if m.is_terminal]


def stats_of(pair: SessionPair) -> tuple[int, int, int]:
    """Consumer (loads in flight, loads aborting, stale answers)."""
    c = pair.a.session.statistics().consumer
    return c.loads_in_flight, c.loads_aborting, c.stale_answers


class TestFetch:
    """A load is one ``fetch`` that opens round r and moves the counter (invariant 5)."""

    def test_request_blocks_sends_one_fetch_with_the_current_round(self) -> None:
        """Keys and our slots go out pairwise in one fetch for round 0."""
        pair = SessionPair()
        fetch(pair, [key(0), key(1)], [3, 4], ID)

        assert sent(pair.a, Fetch) == [
            Fetch(kv_request_id=ID, keys=(key(0), key(1)), block_indexes=(3, 4), round_seq=0)
        ]
        assert pair.a.session.statistics().consumer.fetches_sent == 1

    def test_rounds_increase_per_fetch_and_per_id(self) -> None:
        """Each fetch of an id takes the next round; another id counts on its own."""
        pair = SessionPair()
        for n in range(3):
            fetch(pair, [key(n)], [n], ID)
        fetch(pair, [key(9)], [9], "req-2")

        rounds = [(m.kv_request_id, m.round_seq) for m in sent(pair.a, Fetch)]
        assert rounds == [(ID, 0), (ID, 1), (ID, 2), ("req-2", 0)]


class TestInvalidLoads:
    """A load its peer must reject never reaches the wire.

    Slot indexes outside our region break docs/protocol.md §5; duplicate keys are a
    protocol error to our own producer. Such a load is our engine's mistake: it
    may raise ProtocolError or fail as a job, but it must not end the session
    and every other load with it.
    """

    @pytest.mark.parametrize(
        ("keys", "slots"),
        [
            pytest.param([key(0), key(1)], [3], id="length-mismatch"),
            pytest.param([], [], id="empty"),
            pytest.param([key(0)], [64], id="slot-past-region"),
            pytest.param([key(0)], [-1], id="negative-slot"),
            pytest.param([key(0), key(0)], [3, 4], id="duplicate-key"),
        ],
    )
    def test_invalid_load_is_refused_locally(self, keys: list[Key], slots: list[int]) -> None:
        """Nothing is sent, no slot opens, and a load already in flight survives."""
        pair = SessionPair(num_blocks=64)
        other = fetch(pair, [key(9)], [9], "req-2")
        pair.pump()
        frames = len(pair.a.outbox.log)
        job = pair.next_job_id()

        try:
            pair.a.session.request_blocks(job, ID, keys, slots, pair.clock.now)
        except ProtocolError:
            refused = True
        else:
            pair.poll()
            refused = job in pair.a.loads and not pair.a.loads[job].success
        frames_sent = len(pair.a.outbox.log) - frames
        assert frames_sent == 0, "the invalid load went on the wire"
        pair.pump()

        assert refused, "the invalid load neither raised nor failed at once"
        assert pair.a.closed is None
        assert pair.b.closed is None
        assert pair.a.plane.open_slots_for("b") == {9}
        assert other not in pair.a.loads


class TestConcurrentLoads:
    """Several loads of one id complete in any order, each reported once."""

    def test_crafted_completions_out_of_order(self) -> None:
        """transfer_done for rounds 1, 2, 0 reports each job with its own outcome."""
        pair = SessionPair()
        jobs = [fetch(pair, [key(n)], [n], ID) for n in range(3)]

        inject(pair, pair.a, done(1))
        pair.poll()
        assert set(pair.a.loads) == {jobs[1]}
        assert pair.a.loads[jobs[1]].success

        inject(pair, pair.a, done(2, success=False, reason="peer lost the block"))
        inject(pair, pair.a, done(0))
        pair.poll()

        assert {j: r.success for j, r in pair.a.loads.items()} == {
            jobs[0]: True,
            jobs[1]: True,
            jobs[2]: False,
        }
        assert pair.a.loads[jobs[2]].reason == "peer lost the block"
        assert stats_of(pair) == (0, 0, 0)

    def test_duplicate_or_foreign_transfer_done_is_stale(self) -> None:
        """A second transfer_done, or one for an unknown id, reports nothing."""
        pair = SessionPair()
        job = fetch(pair, [key(0)], [3], ID)
        inject(pair, pair.a, done(0))
        pair.poll()

        inject(pair, pair.a, done(0, success=False))
        inject(pair, pair.a, TransferDone(kv_request_id="req-other", success=True, round_seq=0))
        pair.poll()

        assert list(pair.a.loads) == [job]
        assert pair.a.loads[job].success
        assert stats_of(pair) == (0, 0, 2)
        assert pair.a.session.alive

    def test_producer_rounds_complete_out_of_order(self) -> None:
        """Two symmetric rounds served by b; the later round's write finishes first."""
        pair = SessionPair()
        pair.b.parent.put(key(0))
        pair.b.parent.put(key(1))
        probe(pair, ID, key(0))
        serve_lookups(pair)
        first = fetch(pair, [key(0)], [10], ID)
        pair.pump()
        probe(pair, ID, key(1))
        serve_lookups(pair)
        second = fetch(pair, [key(1)], [11], ID)
        pair.pump()
        write_0, write_1 = sorted(pair.b.plane.pending)

        pair.b.plane.complete(write_1)
        pair.pump()
        assert set(pair.a.loads) == {second}

        pair.b.plane.complete(write_0)
        pair.pump()
        assert pair.a.loads[first].success
        assert pair.a.loads[second].success
        assert [m.round_seq for m in sent(pair.b, TransferDone)] == [1, 0]
        assert pair.a.region.block(10) == pair.b.parent.expected(key(0))
        assert pair.a.region.block(11) == pair.b.parent.expected(key(1))


class TestLoadTimeout:
    """No transfer_done within ``load_timeout_s``: abort, then fail (§5.7)."""

    def test_abort_at_the_deadline_not_before_and_only_once(self) -> None:
        """One abort_fetch for the round at the deadline; the job waits for the ack."""
        pair = SessionPair(settings=PATIENT)
        timeout = pair.settings.load_timeout_s
        start = pair.clock.now
        job = fetch(pair, [key(0)], [3], ID)
        assert pair.a.session.next_deadline() == start + timeout

        pair.advance(timeout - 1)
        pair.poll()
        assert sent(pair.a, AbortFetch) == []

        pair.advance(1)
        pair.poll()
        for _ in range(3):
            pair.advance(1)
            pair.poll()

        assert sent(pair.a, AbortFetch) == [AbortFetch(kv_request_id=ID, round_seq=0)]
        assert job not in pair.a.loads
        assert stats_of(pair)[:2] == (1, 1)
        assert pair.a.session.next_deadline() == start + timeout + pair.settings.abort_ack_timeout_s

    def test_give_up_aborts_before_the_load_timeout(self) -> None:
        """The router's ``give_up_s``: the round is aborted that long after it was sent
        (computing is faster by then), counted apart from load timeouts."""
        pair = SessionPair(settings=PATIENT)
        start = pair.clock.now
        job = pair.next_job_id()
        pair.a.session.request_blocks(job, ID, [key(0)], [3], start, give_up_s=0.5)
        assert pair.a.session.next_deadline() == start + 0.5
        pair.advance(0.4)
        pair.poll()
        assert sent(pair.a, AbortFetch) == []
        pair.advance(0.1)
        pair.poll()
        assert sent(pair.a, AbortFetch) == [AbortFetch(kv_request_id=ID, round_seq=0)]
        pair.pump()  # b acks the abort: the load fails, saying why
        assert not pair.a.loads[job].success
        assert "give_up_s" in pair.a.loads[job].reason
        timeouts = pair.a.session.statistics().consumer.timeouts
        assert timeouts.get("give_up") == 1
        assert not timeouts.get("load")

    def test_a_give_up_later_than_the_load_timeout_changes_nothing(self) -> None:
        pair = SessionPair(settings=PATIENT)
        start = pair.clock.now
        pair.a.session.request_blocks(pair.next_job_id(), ID, [key(0)], [3], start,
                                      give_up_s=pair.settings.load_timeout_s + 5)  # fmt: skip
        assert pair.a.session.next_deadline() == start + pair.settings.load_timeout_s

    def test_abort_ack_fails_the_load_with_a_reason(self) -> None:
        """The producer's abort_ack ends the load as a failure that says why."""
        pair = SessionPair()
        job = fetch(pair, [key(0)], [3], ID)
        pair.pump()  # b parks the PD demand: no supply ever comes

        pair.advance(pair.settings.load_timeout_s)
        pair.pump()

        assert sent(pair.b, AbortAck) == [AbortAck(kv_request_id=ID, round_seq=0)]
        assert not pair.a.loads[job].success
        assert pair.a.loads[job].reason
        assert stats_of(pair) == (0, 0, 0)

    def test_missing_ack_fails_the_load_after_the_ack_timeout(self) -> None:
        """Without an ack the load fails abort_ack_timeout_s after the abort, not before."""
        pair = SessionPair(settings=PATIENT)
        job = fetch(pair, [key(0)], [3], ID)
        pair.advance(pair.settings.load_timeout_s)
        pair.poll()  # abort_fetch sent; nothing is delivered from here on

        pair.advance(pair.settings.abort_ack_timeout_s - 1)
        pair.poll()
        assert job not in pair.a.loads

        pair.advance(1)
        pair.poll()
        assert not pair.a.loads[job].success
        assert pair.a.loads[job].reason
        # The entry lingers one more ack timeout for a late ack, then nothing is due.
        linger_until = pair.clock.now + pair.settings.abort_ack_timeout_s
        assert pair.a.session.next_deadline() == linger_until
        pair.advance(pair.settings.abort_ack_timeout_s)
        pair.poll()
        assert pair.a.session.next_deadline() is None
        assert pair.a.session.statistics().consumer.requests == 1  # until it finishes
        pair.a.session.finish_consumer(ID, pair.clock.now)
        assert pair.a.session.statistics().consumer.requests == 0

    def test_reused_id_after_an_unacked_abort_keeps_counting_rounds(self) -> None:
        """A late abort_ack of round 0 cannot complete a newer load of the same id."""
        pair = SessionPair(settings=PATIENT)
        old = fetch(pair, [key(0)], [3], ID)
        pair.advance(pair.settings.load_timeout_s)
        pair.poll()  # abort_fetch for round 0 goes out, never acknowledged
        pair.advance(pair.settings.abort_ack_timeout_s)
        pair.poll()
        assert not pair.a.loads[old].success

        new = fetch(pair, [key(1)], [4], ID)
        rounds = [m.round_seq for m in pair.a.sent_of(Fetch) if isinstance(m, Fetch)]
        assert rounds == [0, 1]
        inject(pair, pair.a, AbortAck(kv_request_id=ID, round_seq=0))  # the late ack
        pair.poll()
        assert new not in pair.a.loads

    def test_late_answers_after_the_ack_timeout_are_ignored(self) -> None:
        """A late abort_ack and transfer_done change nothing and count as stale."""
        pair = SessionPair(settings=PATIENT)
        job = fetch(pair, [key(0)], [3], ID)
        pair.pump()
        pair.advance(pair.settings.load_timeout_s)
        pair.poll()
        pair.advance(pair.settings.abort_ack_timeout_s)
        pair.poll()
        failed = pair.a.loads[job]

        pair.pump()  # b finally receives the abort and acks it
        inject(pair, pair.a, done(0))
        pair.poll()

        assert sent(pair.b, AbortAck) == [AbortAck(kv_request_id=ID, round_seq=0)]
        assert pair.a.loads == {job: failed}
        assert stats_of(pair) == (0, 0, 2)

    def test_timeout_of_one_round_leaves_the_next_round_alone(self) -> None:
        """Round 0 times out and aborts; round 1, submitted later, completes."""
        pair = SessionPair(settings=PATIENT)
        first = fetch(pair, [key(0)], [3], ID)
        pair.advance(pair.settings.load_timeout_s / 2)
        second = fetch(pair, [key(1)], [4], ID)

        pair.advance(pair.settings.load_timeout_s / 2)
        pair.poll()
        assert sent(pair.a, AbortFetch) == [AbortFetch(kv_request_id=ID, round_seq=0)]

        inject(pair, pair.a, done(1))
        inject(pair, pair.a, AbortAck(kv_request_id=ID, round_seq=0))
        pair.poll()
        assert pair.a.loads[second].success
        assert not pair.a.loads[first].success

    def test_transfer_done_while_aborting_reports_the_real_outcome(self) -> None:
        """A transfer_done that crossed our abort ends the load; the ack is then stale."""
        pair = SessionPair()
        job = fetch(pair, [key(0)], [3], ID)
        pair.advance(pair.settings.load_timeout_s)
        pair.poll()

        inject(pair, pair.a, done(0))
        inject(pair, pair.a, AbortAck(kv_request_id=ID, round_seq=0))
        pair.poll()

        assert pair.a.loads[job].success
        assert stats_of(pair) == (0, 0, 1)


class TestFinish:
    """Finishing our request aborts loads and releases the peer (§5.4, invariant 7)."""

    def test_finish_aborts_loads_and_reports_them_on_ack(self) -> None:
        """Each in-flight load gets abort_fetch and is reported once, after the ack."""
        pair = SessionPair()
        jobs = [fetch(pair, [key(n)], [n], ID) for n in range(2)]
        pair.pump()

        pair.a.session.finish_consumer(ID, pair.clock.now)
        assert {m.round_seq for m in sent(pair.a, AbortFetch)} == {0, 1}
        assert len(sent(pair.a, AbortFetch)) == 2
        assert stats_of(pair)[:2] == (2, 2)
        pair.poll()
        assert pair.a.loads == {}

        pair.pump()
        assert sorted(pair.a.loads) == jobs
        assert not any(r.success for r in pair.a.loads.values())
        assert terminal_fetches(pair.a) == []

    def test_finish_reports_loads_when_no_ack_comes(self) -> None:
        """Loads of a finished request are never dropped: the ack timeout fails them."""
        pair = SessionPair(settings=PATIENT)
        jobs = [fetch(pair, [key(n)], [n], ID) for n in range(2)]
        pair.a.session.finish_consumer(ID, pair.clock.now)

        pair.advance(pair.settings.abort_ack_timeout_s - 1)
        pair.poll()
        assert pair.a.loads == {}

        pair.advance(1)
        pair.poll()
        assert sorted(pair.a.loads) == jobs
        assert not any(r.success for r in pair.a.loads.values())

    def test_finish_does_not_abort_an_aborting_load_again(self) -> None:
        """A load already aborted by its timeout gets no second abort_fetch."""
        pair = SessionPair()
        fetch(pair, [key(0)], [3], ID)
        pair.advance(pair.settings.load_timeout_s)
        pair.poll()

        pair.a.session.finish_consumer(ID, pair.clock.now)

        assert len(sent(pair.a, AbortFetch)) == 1

    def test_finish_after_flushed_lookup_sends_empty_fetch(self) -> None:
        """The peer holds lookup state: one terminal fetch; the peer unpins its hits."""
        pair = SessionPair()
        pair.b.parent.put(key(0))
        probe(pair, ID, key(0), key(1))
        serve_lookups(pair)
        assert pair.b.parent.pinned_slots() == 1

        pair.a.session.finish_consumer(ID, pair.clock.now)
        pair.pump()

        assert sent(pair.a, Fetch) == [
            Fetch(kv_request_id=ID, keys=(), block_indexes=(), round_seq=0)
        ]
        assert pair.b.parent.pinned_slots() == 0
        assert [store.success for store in pair.b.stores.values()] == [True]

    def test_finish_after_unanswered_lookup_sends_empty_fetch(self) -> None:
        """A flushed lookup the peer never answered still owes the terminal fetch."""
        pair = SessionPair()
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()

        pair.a.session.finish_consumer(ID, pair.clock.now)

        assert len(terminal_fetches(pair.a)) == 1

    def test_finish_without_lookup_sends_no_fetch(self) -> None:
        """No lookup ever went out: nothing to release."""
        pair = SessionPair()
        job = fetch(pair, [key(0)], [3], ID)
        inject(pair, pair.a, done(0))
        pair.poll()
        frames = len(pair.a.sent())

        pair.a.session.finish_consumer(ID, pair.clock.now)

        assert pair.a.loads[job].success
        assert len(pair.a.sent()) == frames

    def test_finish_after_real_fetch_sends_no_second_fetch(self) -> None:
        """The fetch already closed the round, so finish adds no empty fetch."""
        pair = SessionPair()
        pair.b.parent.put(key(0))
        probe(pair, ID, key(0))
        serve_lookups(pair)
        fetch(pair, [key(0)], [3], ID)
        pair.pump()
        pair.b.plane.complete_all()
        pair.pump()

        pair.a.session.finish_consumer(ID, pair.clock.now)

        assert len(sent(pair.a, Fetch)) == 1
        assert terminal_fetches(pair.a) == []

    def test_finish_with_unflushed_probes_sends_nothing(self) -> None:
        """Probes never flushed are dropped: no lookup, no fetch, now or later."""
        pair = SessionPair()
        frames = len(pair.a.sent())
        probe(pair, ID, key(0), key(1))

        pair.a.session.finish_consumer(ID, pair.clock.now)
        pair.a.session.flush_lookups()

        assert len(pair.a.sent()) == frames

    def test_finish_with_load_and_later_lookup_sends_both(self) -> None:
        """A load of round 0 in flight and a lookup for round 1: abort and empty fetch."""
        pair = SessionPair()
        fetch(pair, [key(0)], [3], ID)
        probe(pair, ID, key(1))
        pair.a.session.flush_lookups()

        pair.a.session.finish_consumer(ID, pair.clock.now)

        assert sent(pair.a, AbortFetch) == [AbortFetch(kv_request_id=ID, round_seq=0)]
        assert terminal_fetches(pair.a) == [
            Fetch(kv_request_id=ID, keys=(), block_indexes=(), round_seq=1)
        ]

    def test_finish_of_unknown_id_is_a_noop(self) -> None:
        """Finishing an id we know nothing about sends and reports nothing."""
        pair = SessionPair()
        fetch(pair, [key(0)], [3], ID)
        frames = len(pair.a.sent())

        pair.a.session.finish_consumer("req-unknown", pair.clock.now)
        pair.poll()

        assert len(pair.a.sent()) == frames
        assert pair.a.loads == {}
        assert stats_of(pair) == (1, 0, 0)


class TestClose:
    """A closed session fails what it held and names the ids that cannot resolve."""

    def test_close_lists_ids_with_loads_or_unresolved_probes(self) -> None:
        """Ids with loads or waiting probes are listed once; resolved ones are not."""
        pair = SessionPair()
        jobs = [
            fetch(pair, [key(0)], [0], "loading"),
            fetch(pair, [key(1)], [1], "two-loads"),
            fetch(pair, [key(2)], [2], "two-loads"),
        ]
        probe(pair, "waiting", key(3))
        probe(pair, "resolved", key(4))
        pair.a.session.flush_lookups()
        answer = LookupResponse(kv_request_id="resolved", keys=(key(4),), hits=(True,), round_seq=0)
        inject(pair, pair.a, answer)

        pair.a.session.close()
        pair.poll()

        closed = pair.a.closed
        assert closed is not None
        assert closed.kind is CloseKind.LOCAL
        assert sorted(closed.failed_request_ids) == ["loading", "two-loads", "waiting"]
        assert sorted(load.job_id for load in closed.loads) == jobs
        assert not any(load.success for load in closed.loads)

    def test_close_counts_an_aborting_load_once(self) -> None:
        """A load waiting for its abort_ack is failed by the close, exactly once."""
        pair = SessionPair()
        job = fetch(pair, [key(0)], [3], ID)
        pair.advance(pair.settings.load_timeout_s)
        pair.poll()

        pair.a.session.close()
        pair.poll()
        pair.advance(pair.settings.abort_ack_timeout_s)
        pair.poll()

        closed = pair.a.closed
        assert closed is not None
        assert [load.job_id for load in closed.loads] == [job]
        assert closed.failed_request_ids == (ID,)
        assert not pair.a.loads[job].success

    def test_closed_session_answers_miss_and_fails_new_loads(self) -> None:
        """After close a waiting probe answers MISS and a new load fails at once."""
        pair = SessionPair()
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        pair.a.session.close()

        assert probe(pair, ID, key(0), key(1)) == [False, False]
        job = fetch(pair, [key(0)], [3], ID)
        pair.poll()
        assert not pair.a.loads[job].success
        assert sent(pair.a, Fetch) == []


class TestWriteWindow:
    """Our slots are open for the producer exactly while a load may be written."""

    def test_slots_are_open_while_the_load_runs(self) -> None:
        """Opened at the fetch, closed when transfer_done reports the load."""
        pair = SessionPair()
        fetch(pair, [key(0), key(1)], [3, 4], ID)
        assert pair.a.plane.open_slots_for("b") == {3, 4}

        inject(pair, pair.a, done(0))
        pair.poll()

        assert pair.a.plane.open_slots_for("b") == set()

    def test_failed_load_closes_its_slots(self) -> None:
        """A transfer_done(false) closes the slots too."""
        pair = SessionPair()
        fetch(pair, [key(0)], [3], ID)

        inject(pair, pair.a, done(0, success=False))
        pair.poll()

        assert pair.a.plane.open_slots_for("b") == set()

    def test_aborted_load_keeps_its_slots_open_until_the_ack(self) -> None:
        """The peer may still write until it acks: slots stay open, the job unreported."""
        pair = SessionPair()
        job = fetch(pair, [key(0)], [3], ID)
        pair.advance(pair.settings.load_timeout_s)
        pair.poll()
        assert pair.a.plane.open_slots_for("b") == {3}
        assert job not in pair.a.loads

        inject(pair, pair.a, AbortAck(kv_request_id=ID, round_seq=0))
        pair.poll()

        assert pair.a.plane.open_slots_for("b") == set()
        assert not pair.a.loads[job].success

    def test_ack_timeout_closes_the_slots(self) -> None:
        """When the ack never comes, the slots close as the load fails."""
        pair = SessionPair()
        fetch(pair, [key(0)], [3], ID)
        pair.advance(pair.settings.load_timeout_s)
        pair.poll()
        pair.advance(pair.settings.abort_ack_timeout_s)
        pair.poll()

        assert pair.a.plane.open_slots_for("b") == set()

    def test_each_load_closes_only_its_own_slots(self) -> None:
        """Completing round 1 leaves round 0's slots open."""
        pair = SessionPair()
        fetch(pair, [key(0), key(1)], [1, 2], ID)
        fetch(pair, [key(2)], [3], ID)

        inject(pair, pair.a, done(1))
        pair.poll()

        assert pair.a.plane.open_slots_for("b") == {1, 2}

    def test_close_closes_every_slot(self) -> None:
        """A closed session leaves nothing open for the peer."""
        pair = SessionPair()
        fetch(pair, [key(0)], [1], ID)
        fetch(pair, [key(1)], [2], "req-2")

        pair.a.session.close()
        pair.poll()

        assert pair.a.plane.open_slots_for("b") == set()
