"""Consumer role, lookup phase: aggregated probes, their answers, the lookup timeout.

Node ``a`` is the consumer and node ``b`` the producer. Pins consumer invariants
1-4 and the lookup-to-fetch boundary, up to a byte-exact symmetric pull
(docs/design.md §5.2, §5.8; vLLM TestLookupFlow). Hand-made producer answers are
delivered straight to ``a`` after the handshake.
"""

from __future__ import annotations

from typing import TypeVar

import pytest

from kvpeer.protocol import Codec, Fetch, Lookup, LookupResponse, Message, TransferDone
from kvpeer.session import SessionSettings
from kvpeer.testing import SessionPair
from kvpeer.testing.steps import fetch, probe, sent, serve_lookups
from kvpeer.types import Key

ID = "req-1"
M = TypeVar("M", bound=Message)


def key(n: int) -> Key:
    """A block key: a prefix-hash stand-in followed by a 4-byte group index."""
    return f"prefix-hash-{n:04d}".encode() + (0).to_bytes(4, "big")




def answer(
    pair: SessionPair,
    keys: tuple[Key, ...],
    hits: tuple[bool, ...],
    round_seq: int | None = 0,
    kv_request_id: str = ID,
) -> None:
    """Deliver a hand-made ``lookup_resp`` to the consumer."""
    message = LookupResponse(kv_request_id=kv_request_id, keys=keys, hits=hits, round_seq=round_seq)
    pair.a.session.receive(Codec().encode(message), pair.clock.now)



def stale_answers(pair: SessionPair) -> int:
    return pair.a.session.statistics().consumer.stale_answers



class TestLookupAggregation:
    """Probes registered in one step go out as one ``lookup`` per id per flush."""

    def test_probes_of_one_step_go_out_as_one_lookup(self) -> None:
        """Repeated and new probes of one id become one lookup, keys once, in order."""
        pair = SessionPair()
        keys = [key(n) for n in range(5)]
        assert probe(pair, ID, *keys) == [None] * 5
        assert probe(pair, ID, keys[0], keys[2], keys[0]) == [None] * 3
        assert sent(pair.a, Lookup) == []  # nothing leaves before the flush

        pair.a.session.flush_lookups()

        assert sent(pair.a, Lookup) == [Lookup(kv_request_id=ID, keys=tuple(keys), round_seq=0)]
        assert pair.a.session.statistics().consumer.lookups_sent == 1

    def test_each_request_id_gets_its_own_lookup(self) -> None:
        """Interleaved probes of two ids give two lookups, each with its own keys."""
        pair = SessionPair()
        probe(pair, "req-1", key(0))
        probe(pair, "req-2", key(1))
        probe(pair, "req-1", key(2))
        probe(pair, "req-2", key(0))

        pair.a.session.flush_lookups()

        lookups = sent(pair.a, Lookup)
        assert len(lookups) == 2
        by_id = {m.kv_request_id: m for m in lookups}
        assert by_id["req-1"].keys == (key(0), key(2))
        assert by_id["req-2"].keys == (key(1), key(0))
        assert {m.round_seq for m in lookups} == {0}

    def test_probes_of_a_later_step_go_out_in_the_same_round(self) -> None:
        """New keys found in a later step get another lookup, still for round 0."""
        pair = SessionPair()
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        probe(pair, ID, key(0), key(1))
        pair.a.session.flush_lookups()

        assert sent(pair.a, Lookup) == [
            Lookup(kv_request_id=ID, keys=(key(0),), round_seq=0),
            Lookup(kv_request_id=ID, keys=(key(1),), round_seq=0),
        ]

    def test_flush_with_nothing_new_sends_nothing(self) -> None:
        """An empty flush, a second flush and a re-probe of a sent key send nothing."""
        pair = SessionPair()
        frames = len(pair.a.sent())
        pair.a.session.flush_lookups()
        assert len(pair.a.sent()) == frames

        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        pair.a.session.flush_lookups()
        assert probe(pair, ID, key(0)) == [None]
        pair.a.session.flush_lookups()

        assert len(sent(pair.a, Lookup)) == 1
        assert len(pair.a.sent()) == frames + 1


class TestAnswersFromProducer:
    """The producer's HIT/MISS answers resolve the probes and are cached."""

    def test_hit_and_miss_resolve_probes(self) -> None:
        """A key the peer holds answers True, one it lacks False, in one lookup_resp."""
        pair = SessionPair()
        pair.b.parent.put(key(0))
        assert probe(pair, ID, key(0), key(1)) == [None, None]

        serve_lookups(pair)

        assert probe(pair, ID, key(0), key(1)) == [True, False]
        assert sent(pair.b, LookupResponse) == [
            LookupResponse(kv_request_id=ID, keys=(key(0), key(1)), hits=(True, False), round_seq=0)
        ]
        assert pair.a.session.statistics().consumer.probes_waiting == 0

    def test_answers_are_cached_and_not_asked_again(self) -> None:
        """A repeated probe returns the cached answer; no further lookup goes out."""
        pair = SessionPair()
        pair.b.parent.put(key(0))
        probe(pair, ID, key(0), key(1))
        serve_lookups(pair)
        asked = pair.b.parent.lookups

        for _ in range(3):
            assert probe(pair, ID, key(0), key(1)) == [True, False]
        serve_lookups(pair)

        assert len(sent(pair.a, Lookup)) == 1
        assert pair.b.parent.lookups == asked

    def test_lookups_of_two_steps_are_both_answered(self) -> None:
        """Two lookups of one round are answered separately and both resolve."""
        pair = SessionPair()
        pair.b.parent.put(key(0))
        pair.b.parent.put(key(1))
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        probe(pair, ID, key(1))

        serve_lookups(pair)

        assert probe(pair, ID, key(0), key(1)) == [True, True]
        assert len(sent(pair.b, LookupResponse)) == 2


class TestCraftedAnswers:
    """Split, foreign, stale and untagged answers (invariant 3)."""

    def test_split_answer_resolves_keys_across_messages(self) -> None:
        """Pairs are matched by key, whatever message and order they come in."""
        pair = SessionPair()
        probe(pair, ID, key(0), key(1), key(2))
        pair.a.session.flush_lookups()

        answer(pair, (key(1),), (True,))
        assert probe(pair, ID, key(0), key(1), key(2)) == [None, True, None]
        assert pair.a.session.statistics().consumer.probes_waiting == 2

        answer(pair, (key(2), key(0)), (False, True))
        assert probe(pair, ID, key(0), key(1), key(2)) == [True, True, False]
        assert pair.a.session.statistics().consumer.probes_waiting == 0
        assert len(sent(pair.a, Lookup)) == 1

    def test_answer_for_unknown_id_is_ignored(self) -> None:
        """An answer for an id we never probed resolves nothing and seeds no cache."""
        pair = SessionPair()
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        before = stale_answers(pair)

        answer(pair, (key(0),), (True,), kv_request_id="req-other")

        assert probe(pair, ID, key(0)) == [None]
        assert probe(pair, "req-other", key(0)) == [None]
        assert stale_answers(pair) == before + 1
        assert pair.a.session.alive

    def test_answer_for_unprobed_key_is_ignored(self) -> None:
        """A key we did not probe is not cached; probing it later asks the peer."""
        pair = SessionPair()
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()

        answer(pair, (key(0), key(9)), (False, True))

        assert probe(pair, ID, key(0), key(9)) == [False, None]
        pair.a.session.flush_lookups()
        assert sent(pair.a, Lookup)[-1].keys == (key(9),)

    def test_resolved_probe_keeps_its_first_answer(self) -> None:
        """A second answer for an already resolved key does not change it."""
        pair = SessionPair()
        probe(pair, ID, key(0), key(1))
        pair.a.session.flush_lookups()
        answer(pair, (key(0), key(1)), (True, False))

        answer(pair, (key(0), key(1)), (False, True))

        assert probe(pair, ID, key(0), key(1)) == [True, False]

    def test_answer_for_a_closed_round_does_not_resolve_the_new_round(self) -> None:
        """After a fetch closed round 0, a round-0 answer is stale; round 1's counts."""
        pair = SessionPair()
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        answer(pair, (key(0),), (True,))
        fetch(pair, [key(0)], [3], ID)
        assert probe(pair, ID, key(0)) == [None]
        pair.a.session.flush_lookups()
        assert sent(pair.a, Lookup)[-1] == Lookup(kv_request_id=ID, keys=(key(0),), round_seq=1)
        before = stale_answers(pair)

        answer(pair, (key(0),), (True,), round_seq=0)

        assert probe(pair, ID, key(0)) == [None]
        assert stale_answers(pair) == before + 1

        answer(pair, (key(0),), (False,), round_seq=1)
        assert probe(pair, ID, key(0)) == [False]

    def test_untagged_answer_is_matched_by_key(self) -> None:
        """A vLLM peer sends no round_seq: its answer resolves probes key by key."""
        pair = SessionPair()
        probe(pair, ID, key(0), key(1))
        pair.a.session.flush_lookups()

        answer(pair, (key(1), key(0)), (True, False), round_seq=None)

        assert probe(pair, ID, key(0), key(1)) == [False, True]

    def test_untagged_answer_resolves_a_later_round(self) -> None:
        """Without a round tag an answer is taken for the current round's probes."""
        pair = SessionPair()
        fetch(pair, [key(5)], [3], ID)
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        assert sent(pair.a, Lookup)[-1].round_seq == 1

        answer(pair, (key(0),), (True,), round_seq=None)

        assert probe(pair, ID, key(0)) == [True]


class TestFetchClosesTheRound:
    """Only confirmed hits are fetched, and the fetch ends the round's probes."""

    def test_fetch_clears_the_probe_cache(self) -> None:
        """After a fetch the same key is probed anew, in the next round."""
        pair = SessionPair()
        pair.b.parent.put(key(0))
        probe(pair, ID, key(0))
        serve_lookups(pair)
        assert probe(pair, ID, key(0)) == [True]

        fetch(pair, [key(0)], [7], ID)
        assert probe(pair, ID, key(0)) == [None]
        serve_lookups(pair)

        assert sent(pair.a, Lookup)[-1] == Lookup(kv_request_id=ID, keys=(key(0),), round_seq=1)
        assert probe(pair, ID, key(0)) == [True]

    def test_a_missed_key_stays_missed_after_the_fetch(self) -> None:
        """A key answered MISS is not asked again in a later round of the same request:
        its second answer would wait for another producer serve window (issue 14)."""
        pair = SessionPair()
        pair.b.parent.put(key(0))
        probe(pair, ID, key(0), key(1))
        serve_lookups(pair)
        fetch(pair, [key(0)], [7], ID)
        lookups_before = len(sent(pair.a, Lookup))

        assert probe(pair, ID, key(1)) == [False]
        pair.pump()
        assert len(sent(pair.a, Lookup)) == lookups_before

    def test_a_missed_key_is_asked_again_by_the_next_request_of_the_id(self) -> None:
        """The MISS memory ends with the request: a reused id asks anew."""
        pair = SessionPair()
        probe(pair, ID, key(1))
        serve_lookups(pair)
        assert probe(pair, ID, key(1)) == [False]
        pair.a.session.finish_consumer(ID, pair.clock.now)
        pair.pump()

        pair.b.parent.put(key(1))
        assert probe(pair, ID, key(1)) == [None]
        serve_lookups(pair)
        assert probe(pair, ID, key(1)) == [True]

    def test_fetch_of_a_missed_key_fails_at_once(self) -> None:
        """A key the peer answered MISS fails the load now: no fetch, no open slots.

        The peer's pin of the hit is still released by the terminal fetch on finish.
        """
        pair = SessionPair()
        pair.b.parent.put(key(0))
        probe(pair, ID, key(0), key(1))
        serve_lookups(pair)

        job = fetch(pair, [key(0), key(1)], [3, 4], ID)
        pair.poll()

        assert not pair.a.loads[job].success
        assert pair.a.loads[job].reason
        assert sent(pair.a, Fetch) == []
        assert pair.a.plane.open_slots_for("b") == set()

        pair.a.session.finish_consumer(ID, pair.clock.now)
        pair.pump()
        assert sent(pair.a, Fetch) == [
            Fetch(kv_request_id=ID, keys=(), block_indexes=(), round_seq=0)
        ]
        assert pair.b.parent.pinned_slots() == 0

    def test_fetch_of_an_unanswered_key_fails_at_once(self) -> None:
        """A key whose probe is still unanswered is not confirmed: the load fails now."""
        pair = SessionPair()
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()

        job = fetch(pair, [key(0)], [3], ID)
        pair.poll()

        assert not pair.a.loads[job].success
        assert sent(pair.a, Fetch) == []


class TestLookupTimeout:
    """Unanswered probes become MISS after ``lookup_timeout_s`` (invariant 4, §5.8)."""

    @pytest.mark.parametrize("timeout", [5.0, 30.0])
    def test_unanswered_probes_become_miss_at_the_deadline(self, timeout: float) -> None:
        """Still RETRY just before the deadline, MISS at it; the id is reported."""
        pair = SessionPair(settings=SessionSettings(lookup_timeout_s=timeout, peer_wait_s=1e6))
        start = pair.clock.now
        probe(pair, ID, key(0), key(1))
        pair.a.session.flush_lookups()
        assert pair.a.session.next_deadline() == start + timeout

        pair.advance(timeout - 1)
        pair.poll()
        assert probe(pair, ID, key(0), key(1)) == [None, None]
        assert pair.a.expired_probe_ids == []

        pair.advance(1)
        pair.poll()
        assert probe(pair, ID, key(0), key(1)) == [False, False]
        assert pair.a.expired_probe_ids == [ID]
        assert pair.a.session.statistics().consumer.probes_waiting == 0

    def test_expiry_is_reported_once_and_never_turns_back_to_retry(self) -> None:
        """Later polls and probes keep answering MISS and report the id no more."""
        pair = SessionPair(settings=SessionSettings(peer_wait_s=1e6))
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        pair.advance(pair.settings.lookup_timeout_s)
        pair.poll()

        for _ in range(3):
            pair.advance(100)
            pair.poll()
            assert probe(pair, ID, key(0)) == [False]
        pair.a.session.flush_lookups()

        assert pair.a.expired_probe_ids == [ID]
        assert len(sent(pair.a, Lookup)) == 1

    def test_late_answer_after_expiry_is_ignored(self) -> None:
        """A HIT arriving after the probe expired does not flip the MISS."""
        pair = SessionPair()
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        pair.advance(pair.settings.lookup_timeout_s)
        pair.poll()

        answer(pair, (key(0),), (True,))

        assert probe(pair, ID, key(0)) == [False]

    def test_answered_probes_keep_their_answer(self) -> None:
        """Only the unanswered probes of the id expire."""
        pair = SessionPair()
        probe(pair, ID, key(0), key(1))
        pair.a.session.flush_lookups()
        answer(pair, (key(0),), (True,))

        pair.advance(pair.settings.lookup_timeout_s)
        pair.poll()

        assert probe(pair, ID, key(0), key(1)) == [True, False]
        assert pair.a.expired_probe_ids == [ID]

    def test_answered_probes_never_expire(self) -> None:
        """Once every probe is answered there is no deadline and nothing expires."""
        pair = SessionPair()
        pair.b.parent.put(key(0))
        assert pair.a.session.next_deadline() is None
        probe(pair, ID, key(0))
        serve_lookups(pair)

        assert pair.a.session.next_deadline() is None
        pair.advance(10 * pair.settings.lookup_timeout_s)
        pair.poll()
        assert probe(pair, ID, key(0)) == [True]
        assert pair.a.expired_probe_ids == []

    def test_each_id_has_its_own_deadline(self) -> None:
        """An id probed later is not expired with an earlier one."""
        pair = SessionPair(settings=SessionSettings(peer_wait_s=1e6))
        timeout = pair.settings.lookup_timeout_s
        start = pair.clock.now
        probe(pair, "req-1", key(0))
        pair.advance(10)
        probe(pair, "req-2", key(0))
        pair.a.session.flush_lookups()

        pair.advance(timeout - 10)
        pair.poll()
        assert pair.a.expired_probe_ids == ["req-1"]
        assert probe(pair, "req-2", key(0)) == [None]
        assert pair.a.session.next_deadline() == start + 10 + timeout

        pair.advance(10)
        pair.poll()
        assert pair.a.expired_probe_ids == ["req-1", "req-2"]
        assert probe(pair, "req-2", key(0)) == [False]

    def test_expired_probe_fails_a_fetch_at_once(self) -> None:
        """A key that expired to MISS is not fetched: the load fails, no fetch is sent."""
        pair = SessionPair()
        probe(pair, ID, key(0))
        pair.a.session.flush_lookups()
        pair.advance(pair.settings.lookup_timeout_s)
        pair.poll()

        job = fetch(pair, [key(0)], [3], ID)
        pair.poll()

        assert not pair.a.loads[job].success
        assert sent(pair.a, Fetch) == []


class TestNoLeftoverState:
    """Finished requests leave no per-id state behind, whatever path they took."""

    def test_many_finished_requests_leave_nothing(self) -> None:
        """Answered, expired, fetched and failed-at-once ids all vanish on finish.

        The lookup timeout is shorter than the producer's store timeout, so the
        producer's pins can only be released by the consumer's fetches and finishes.
        """
        pair = SessionPair(settings=SessionSettings(lookup_timeout_s=5.0))
        pair.b.parent.put(key(0))
        ids = [f"req-{n}" for n in range(40)]
        expiring = ids[::4]
        expected: dict[int, bool] = {}  # load job -> outcome
        for n, kv_id in enumerate(ids):
            if kv_id in expiring:
                continue
            probe(pair, kv_id, key(0), key(1))
            serve_lookups(pair)
            if n % 4 >= 2:  # fetch the hit (succeeds) or the miss (fails at once)
                job = pair.next_job_id()
                wanted = key(0) if n % 4 == 2 else key(1)
                pair.a.session.request_blocks(job, kv_id, [wanted], [n], pair.clock.now)
                expected[job] = n % 4 == 2
        for kv_id in expiring:
            probe(pair, kv_id, key(0), key(1))
        pair.a.session.flush_lookups()
        pair.pump()  # b queues these lookups but never serves them
        pair.b.plane.complete_all()
        pair.pump()
        pair.advance(pair.settings.lookup_timeout_s)
        pair.poll()
        assert sorted(pair.a.expired_probe_ids) == sorted(expiring)

        for kv_id in ids:
            pair.a.session.finish_consumer(kv_id, pair.clock.now)
        pair.pump()

        stats = pair.a.session.statistics().consumer
        assert (stats.requests, stats.loads_in_flight, stats.probes_waiting) == (0, 0, 0)
        assert pair.a.session.next_deadline() is None
        assert {job: load.success for job, load in pair.a.loads.items()} == expected
        assert pair.b.parent.pinned_slots() == 0
        assert pair.b.session.statistics().producer.requests == 0


class TestBytes:
    """The whole symmetric pull lands the producer's bytes in the consumer's slots."""

    def test_symmetric_pull_is_byte_exact(self) -> None:
        """Probe, fetch into other slots, complete: bytes equal, no violations, no pins."""
        pair = SessionPair()
        keys = [key(n) for n in range(4)]
        slots = [20, 21, 22, 23]
        for k in keys:
            pair.b.parent.put(k)
        assert probe(pair, ID, *keys) == [None] * 4
        serve_lookups(pair)
        assert probe(pair, ID, *keys) == [True] * 4

        job = fetch(pair, keys, slots, ID)
        pair.pump()
        assert pair.a.plane.open_slots_for("b") == set(slots)
        pair.b.plane.complete_all()
        pair.pump()

        assert pair.a.loads[job].success
        for k, slot in zip(keys, slots, strict=True):
            assert pair.a.region.block(slot) == pair.b.parent.expected(k)
        assert pair.a.region.block(0) == bytes(pair.a.region.block_len)
        assert pair.b.plane.violations == []
        assert pair.a.plane.open_slots_for("b") == set()
        assert pair.b.parent.pinned_slots() == 0
        assert sent(pair.b, TransferDone) == [
            TransferDone(kv_request_id=ID, success=True, round_seq=0, blocks=4)
        ]
