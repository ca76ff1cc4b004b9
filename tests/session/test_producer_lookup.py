"""Producer role: serving a peer's lookups (docs/design.md §5.2, docs/protocol.md §2).

Node ``b`` is the producer (its keys come from ``pair.b.parent.put``), node
``a`` the consumer. Mirrors vLLM's TestServerLookupHandling scenarios.
"""

from __future__ import annotations

import pytest

from kvpeer.protocol import Codec, Fetch, Lookup, LookupResponse, TransferDone, limits
from kvpeer.session import CloseKind, SessionSettings
from kvpeer.session.producer import MAX_QUEUED_LOOKUP_KEYS
from kvpeer.testing import SessionPair
from kvpeer.testing.steps import inject, sent
from kvpeer.types import Key

KV = "req-1"
K1, K2, K3 = b"key-1", b"key-2", b"key-3"


# -- helpers -------------------------------------------------------------------


def probe(pair: SessionPair, keys: list[Key], kv: str = KV) -> None:
    """Register probes on the consumer, flush them as one lookup and deliver it."""
    for key in keys:
        assert pair.a.session.register_probe(kv, key, pair.clock.now) is None
    pair.a.session.flush_lookups()
    pair.deliver()





def fetch(pair: SessionPair, keys: list[Key], first_slot: int = 10) -> int:
    """The consumer fetches ``keys`` into consecutive slots; returns its load job id."""
    job_id = pair.next_job_id()
    slots = list(range(first_slot, first_slot + len(keys)))
    pair.a.session.request_blocks(job_id, KV, keys, slots, pair.clock.now)
    pair.pump()
    return job_id


def assert_settled(pair: SessionPair) -> None:
    """Nothing is left pinned, open or owed on the producer's parent."""
    parent = pair.b.parent
    assert parent.open_jobs == {}
    assert parent.pinned_slots() == 0
    assert parent.open_requests == {}
    assert pair.b.plane.violations == []
    assert pair.b.closed is None


def finish_consumer(pair: SessionPair) -> None:
    """The consumer's request ends (terminal fetch if owed); producer settles."""
    pair.a.session.finish_consumer(KV, pair.clock.now)
    pair.pump()
    pair.serve()
    pair.pump()


# -- tests -------------------------------------------------------------------


class TestServeWindow:
    def test_lookup_touches_the_parent_only_inside_serve(self) -> None:
        """Receiving and polling queue a lookup; only serve() asks the parent."""
        pair = SessionPair()
        pair.b.parent.put(K1)
        probe(pair, [K1])
        pair.poll()
        pair.advance(1.0)
        pair.pump()
        parent = pair.b.parent
        assert (parent.requests_seen, parent.lookups, parent.open_jobs) == (0, 0, {})
        assert sent(pair.b, LookupResponse) == []

        pair.serve()
        pair.pump()
        assert parent.requests_seen == 1
        assert [r.hits for r in sent(pair.b, LookupResponse)] == [(True,)]
        assert pair.a.session.register_probe(KV, K1, pair.clock.now) is True
        finish_consumer(pair)
        assert_settled(pair)


class TestImmediateAnswers:
    def test_hits_are_pinned_with_one_store_job(self) -> None:
        """All-HIT lookup: one store job pins every key, answered at once."""
        pair = SessionPair()
        slots = [pair.b.parent.put(k) for k in (K1, K2, K3)]
        probe(pair, [K1, K2, K3])
        pair.serve()

        jobs = list(pair.b.parent.open_jobs.values())
        assert len(jobs) == 1
        assert jobs[0].keys == (K1, K2, K3)
        assert pair.b.parent.pins == dict.fromkeys(slots, 1)
        [response] = sent(pair.b, LookupResponse)
        assert (response.keys, response.hits) == ((K1, K2, K3), (True, True, True))
        assert pair.b.parent.open_requests == {}
        pair.pump()
        finish_consumer(pair)
        assert pair.b.stores[jobs[0].job_id].job_id == jobs[0].job_id
        assert_settled(pair)

    def test_all_misses_pin_nothing_and_finish_the_serve_request(self) -> None:
        """All-MISS lookup: no store job, all false, on_request_finished called."""
        pair = SessionPair()
        probe(pair, [K1, K2])
        pair.serve()

        parent = pair.b.parent
        assert parent.open_jobs == {}
        assert parent.finished_jobs == {}
        [response] = sent(pair.b, LookupResponse)
        assert (response.keys, response.hits) == ((K1, K2), (False, False))
        assert parent.requests_seen == 1
        assert parent.open_requests == {}
        pair.pump()
        assert pair.a.session.register_probe(KV, K1, pair.clock.now) is False
        finish_consumer(pair)
        assert_settled(pair)

    def test_response_carries_the_lookup_round(self) -> None:
        """lookup_resp is tagged with the round_seq of the lookup it answers."""
        pair = SessionPair()
        pair.b.parent.put(K1)
        inject(pair, pair.b, Lookup(kv_request_id=KV, keys=(K1, K2), round_seq=3))
        pair.serve()
        [response] = sent(pair.b, LookupResponse)
        assert response.round_seq == 3
        assert (response.keys, response.hits) == ((K1, K2), (True, False))
        inject(pair, pair.b, Fetch(kv_request_id=KV, keys=(), block_indexes=(), round_seq=4))
        pair.pump()
        assert_settled(pair)

    def test_consumer_round_is_echoed_after_a_fetch(self) -> None:
        """After the consumer fetched round 0, its next lookup is answered as round 1."""
        pair = SessionPair()
        pair.b.parent.put(K1)
        pair.b.parent.put(K2)
        probe(pair, [K1])
        pair.serve()
        pair.pump()
        fetch(pair, [K1])
        probe(pair, [K2])
        pair.serve()
        assert [r.round_seq for r in sent(pair.b, LookupResponse)] == [0, 1]
        pair.b.plane.complete_all()
        pair.pump()
        finish_consumer(pair)
        assert_settled(pair)

    def test_duplicate_keys_answered_per_wire_position(self) -> None:
        """A key repeated inside one lookup is answered at each of its positions."""
        pair = SessionPair()
        s1, s3 = pair.b.parent.put(K1), pair.b.parent.put(K3)
        keys = (K1, K2, K1, K3, K2)
        inject(pair, pair.b, Lookup(kv_request_id=KV, keys=keys, round_seq=0))
        pair.serve()
        [response] = sent(pair.b, LookupResponse)
        assert response.keys == keys
        assert response.hits == (True, False, True, True, False)
        assert len(pair.b.parent.open_jobs) == 1
        assert pair.b.parent.pins == {s1: 1, s3: 1}
        inject(pair, pair.b, Fetch(kv_request_id=KV, keys=(), block_indexes=(), round_seq=1))
        pair.pump()
        assert_settled(pair)


class TestPendingKeys:
    def test_mixed_lookup_waits_for_pending_keys(self) -> None:
        """HIT/MISS/HIT_PENDING: one response once the pending key resolves, in wire order."""
        pair = SessionPair()
        parent = pair.b.parent
        parent.put(K1)
        parent.put(K3)
        parent.pending.add(K3)
        probe(pair, [K1, K2, K3])
        pair.serve()

        [first_job] = parent.open_jobs.values()
        assert first_job.keys == (K1,)
        assert sent(pair.b, LookupResponse) == []
        assert len(parent.open_requests) == 1  # the serve request stays open while parked

        parent.pending.discard(K3)
        pair.advance(1.0)
        pair.serve()
        assert len(parent.open_jobs) == 2
        second = next(j for j in parent.open_jobs.values() if j is not first_job)
        assert second.keys == (K3,)
        [response] = sent(pair.b, LookupResponse)
        assert (response.keys, response.hits) == ((K1, K2, K3), (True, False, True))
        assert parent.open_requests == {}

        pair.pump()
        load = fetch(pair, [K1, K3])
        pair.b.plane.complete_all()
        pair.pump()
        assert pair.a.loads[load].success
        assert pair.b.stores[first_job.job_id].success
        assert pair.b.stores[second.job_id].success
        assert pair.a.region.block(10) == parent.expected(K1)
        assert pair.a.region.block(11) == parent.expected(K3)
        assert_settled(pair)

    @pytest.mark.parametrize("kind", ["hit_pending", "retry"])
    def test_unresolved_key_answers_miss_after_pending_timeout(self, kind: str) -> None:
        """HIT_PENDING/RETRY past lookup_pending_timeout_s answers false and is never pinned."""
        pair = SessionPair()
        parent = pair.b.parent
        parent.put(K1)
        parent.put(K2)
        (parent.pending if kind == "hit_pending" else parent.undecided).add(K2)
        probe(pair, [K1, K2])
        pair.serve()
        timeout = pair.settings.lookup_pending_timeout_s

        pair.advance(timeout - 0.5)
        pair.poll()
        pair.serve()
        assert sent(pair.b, LookupResponse) == []

        pair.advance(0.5)
        pair.serve()
        [response] = sent(pair.b, LookupResponse)
        assert (response.keys, response.hits) == ((K1, K2), (True, False))
        [job] = parent.open_jobs.values()
        assert job.keys == (K1,)
        assert parent.pins == {parent.slots[K1]: 1}
        assert parent.open_requests == {}

        # Later readiness of the key changes nothing: it was answered.
        parent.pending.clear()
        parent.undecided.clear()
        pair.serve()
        assert len(parent.open_jobs) == 1
        assert len(sent(pair.b, LookupResponse)) == 1
        pair.pump()
        finish_consumer(pair)
        assert_settled(pair)


class TestOneResponsePerLookup:
    def test_two_lookups_for_one_id_get_two_responses(self) -> None:
        """Each lookup message has its own serve request, job and response."""
        pair = SessionPair()
        parent = pair.b.parent
        parent.put(K1)
        parent.put(K2)
        for key in (K1, K2):
            assert pair.a.session.register_probe(KV, key, pair.clock.now) is None
            pair.a.session.flush_lookups()
        pair.deliver()
        pair.serve()

        answers = [(r.keys, r.hits) for r in sent(pair.b, LookupResponse)]
        assert answers == [((K1,), (True,)), ((K2,), (True,))]
        assert parent.requests_seen == 2
        assert parent.open_requests == {}  # each finished once (the fake asserts no twice)
        assert sorted(j.keys for j in parent.open_jobs.values()) == [(K1,), (K2,)]
        pair.pump()
        load = fetch(pair, [K1, K2])
        pair.b.plane.complete_all()
        pair.pump()
        assert pair.a.loads[load].success
        assert_settled(pair)

    def test_fetch_for_the_round_silences_a_parked_lookup(self) -> None:
        """A lookup still parked when its round is fetched gets no response; its request ends."""
        pair = SessionPair()
        parent = pair.b.parent
        for key in (K1, K2, K3):
            parent.put(key)
        parent.pending.add(K2)
        probe(pair, [K1])
        pair.serve()
        pair.pump()
        probe(pair, [K3, K2])  # K3 pinned at once, K2 parks the lookup
        pair.serve()
        assert len(sent(pair.b, LookupResponse)) == 1
        assert len(parent.open_requests) == 1

        load = fetch(pair, [K1])  # closes round 0 on the producer
        parent.pending.clear()
        pair.serve()
        assert parent.open_requests == {}
        pair.serve()
        assert len(sent(pair.b, LookupResponse)) == 1
        assert all(K2 not in j.keys for j in parent.open_jobs.values())

        pair.b.plane.complete_all()
        pair.pump()
        assert pair.a.loads[load].success
        assert [(d.round_seq, d.success) for d in sent(pair.b, TransferDone)] == [(0, True)]
        assert pair.b.session.statistics().producer.pinned_blocks == 0
        finish_consumer(pair)
        assert_settled(pair)

    def test_terminal_fetch_silences_a_parked_lookup(self) -> None:
        """Terminal empty fetch drops a parked lookup: no response, pins and request released."""
        pair = SessionPair()
        parent = pair.b.parent
        parent.put(K1)
        parent.put(K2)
        parent.pending.add(K2)
        probe(pair, [K1, K2])
        pair.serve()
        assert len(parent.open_jobs) == 1
        assert len(parent.open_requests) == 1

        pair.a.session.finish_consumer(KV, pair.clock.now)
        pair.pump()
        parent.pending.clear()
        pair.serve()
        pair.pump()
        assert sent(pair.b, LookupResponse) == []
        assert sent(pair.b, TransferDone) == []
        assert parent.requests_seen == 1
        stats = pair.b.session.statistics().producer
        assert (stats.pinned_blocks, stats.lookups_queued, stats.requests) == (0, 0, 0)
        assert_settled(pair)


class TestLookupFlood:
    def test_queued_keys_beyond_the_cap_end_the_session(self) -> None:
        """A peer queuing more lookup keys than the cap commits a protocol error
        (with a byte budget large enough not to end it first)."""
        pair = SessionPair(settings=SessionSettings(max_peer_bytes=1 << 40))
        keys = tuple(i.to_bytes(3, "big") for i in range(limits.MAX_ITEMS))
        frame = Codec().encode(Lookup(kv_request_id=KV, keys=keys, round_seq=0))
        fitting = MAX_QUEUED_LOOKUP_KEYS // limits.MAX_ITEMS
        for _ in range(fitting):
            pair.b.session.receive(frame, pair.clock.now)
        assert pair.b.session.alive
        assert pair.b.session.statistics().producer.lookups_queued == fitting * limits.MAX_ITEMS

        pair.b.session.receive(frame, pair.clock.now)
        pair.poll()
        assert pair.b.closed is not None
        assert pair.b.closed.kind is CloseKind.PROTOCOL_ERROR
        assert pair.b.parent.lookups == 0
        assert pair.b.parent.open_requests == {}

    def test_lookups_beyond_the_byte_budget_end_the_session_over_budget(self) -> None:
        """Queued lookups are charged in bytes; the one that would pass the peer's
        budget ends the session (``over_budget``) and nothing of it stays pinned."""
        budget = 4 << 20
        pair = SessionPair(settings=SessionSettings(max_peer_bytes=budget))
        keys = tuple(i.to_bytes(32, "big") for i in range(4096))  # 128 KiB of keys
        frame = Codec().encode(Lookup(kv_request_id=KV, keys=keys, round_seq=0))
        sent = 0
        while pair.b.session.alive and sent < 100:
            pair.b.session.receive(frame, pair.clock.now)
            sent += 1
        assert not pair.b.session.alive
        assert 5 < sent < 40  # ended near the budget, not at the key cap
        pair.poll()
        assert pair.b.closed is not None
        assert pair.b.closed.kind is CloseKind.OVER_BUDGET
        assert "max_peer_bytes" in pair.b.closed.reason
        assert pair.b.parent.open_requests == {}

    def test_many_distinct_ids_are_charged_until_their_requests_end(self) -> None:
        """Each id a peer names costs budget while the producer keeps state for it."""
        pair = SessionPair(settings=SessionSettings(max_peer_bytes=1 << 20))
        codec = Codec()
        sent = 0
        while pair.b.session.alive and sent < 10_000:
            lookup = Lookup(kv_request_id=f"id-{sent}", keys=(b"k" * 32,), round_seq=0)
            pair.b.session.receive(codec.encode(lookup), pair.clock.now)
            pair.serve()
            sent += 1
        assert not pair.b.session.alive
        assert 100 < sent < 10_000
        pair.poll()
        assert pair.b.closed is not None
        assert pair.b.closed.kind is CloseKind.OVER_BUDGET

    def test_one_lookup_whose_answer_would_be_too_big_ends_the_session(self) -> None:
        """A lookup's answer echoes its keys: one may hold a sixteenth of the budget."""
        pair = SessionPair(settings=SessionSettings(max_peer_bytes=16 << 20))
        keys = tuple(i.to_bytes(256, "big") for i in range(4200))  # ~1.03 MiB of keys
        pair.b.session.receive(
            Codec().encode(Lookup(kv_request_id=KV, keys=keys, round_seq=0)), pair.clock.now
        )
        pair.poll()
        assert pair.b.closed is not None
        assert pair.b.closed.kind is CloseKind.OVER_BUDGET
        assert "max_peer_bytes/16" in pair.b.closed.reason
