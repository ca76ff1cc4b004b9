"""PeerSession coordinator: dispatch gating, error policy, close reporting, work and timers.

Pins docs/protocol.md section 6 and invariants 3, 5 and 6 of ``kvpeer.session.peer``,
after vLLM's TestDisconnect / TestAdversarial / TestDispatchErrorHandling
scenarios: a bad frame ends only the session that saw it, with a disconnect
and failed jobs, never an exception out of ``receive()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import pytest

from kvpeer.protocol import (
    AbortAck,
    AbortFetch,
    Codec,
    Connect,
    ConnectAck,
    Disconnect,
    Fetch,
    Lookup,
    LookupResponse,
    Message,
    Prefetch,
    PrefetchRefused,
    TransferDone,
)
from kvpeer.session import CloseKind, PeerSession, SessionSettings
from kvpeer.testing import Fabric, FakeDataPlane, Node, Region, SessionPair, make_hello
from kvpeer.testing.steps import closed, inject, kinds, sent
from kvpeer.types import Key

T = TypeVar("T", bound=Message)

CODEC = Codec()
INITIATORS = pytest.mark.parametrize("first", ["a", "b"])


def connected(first: str = "a", **kwargs: Any) -> SessionPair:
    """A ready pair whose handshake was opened by ``first``."""
    pair = SessionPair(start=False, **kwargs)
    initiator, responder = (pair.a, pair.b) if first == "a" else (pair.b, pair.a)
    initiator.session.start(pair.clock.now)
    responder.session.start(pair.clock.now)
    responder.session.receive(initiator.outbox.in_transit.popleft(), pair.clock.now)
    pair.pump()
    assert pair.a.session.ready
    assert pair.b.session.ready
    return pair






def pd_fetch(
    pair: SessionPair, request_id: str, keys: Sequence[Key], slots: Sequence[int]
) -> tuple[int, int]:
    """A full PD fetch, a from b; returns (load job id, store job id) after checking bytes."""
    now = pair.clock.now
    for key in keys:
        pair.b.parent.put(key)
    store = pair.b.parent.store_job(keys)
    pair.b.session.add_supply(request_id, store, now)
    load = pair.next_job_id()
    pair.a.session.request_blocks(load, request_id, keys, slots, now)
    pair.pump()
    pair.b.plane.complete_all()
    pair.pump()
    assert pair.a.loads[load].success
    assert pair.b.stores[store.job_id].success
    for key, slot in zip(keys, slots, strict=True):
        assert pair.a.region.block(slot) == pair.b.parent.expected(key)
    return load, store.job_id


def assert_protocol_error_isolated(pair: SessionPair, victim: Node, other: Node) -> str:
    """``victim`` ended with PROTOCOL_ERROR and said so; ``other`` only hears the goodbye."""
    other_sent = len(other.sent())
    assert other.session.alive
    assert other.session.ready
    pair.poll()
    result = closed(victim)
    assert result.kind is CloseKind.PROTOCOL_ERROR
    goodbye = victim.sent()[-1]
    assert isinstance(goodbye, Disconnect)
    assert goodbye.reason
    assert goodbye.reason == result.reason
    assert other.closed is None
    pair.pump()
    peer_result = closed(other)
    assert peer_result.kind is CloseKind.DISCONNECTED
    assert goodbye.reason in peer_result.reason
    assert len(other.sent()) == other_sent
    return result.reason


class TestBeforePeerConnect:
    """Only connect and disconnect are accepted before the peer's connect."""

    @pytest.mark.parametrize(
        "message",
        [
            ConnectAck(peer_id="b"),
            Lookup(kv_request_id="r", keys=(b"k",), round_seq=0),
            LookupResponse(kv_request_id="r", keys=(b"k",), hits=(True,)),
            Fetch(kv_request_id="r", keys=(b"k",), block_indexes=(1,), round_seq=0),
            TransferDone(kv_request_id="r", success=True, round_seq=0),
            AbortFetch(kv_request_id="r", round_seq=0),
            AbortAck(kv_request_id="r", round_seq=0),
        ],
        ids=lambda m: type(m).__name__,
    )
    def test_other_message_first_is_a_straggler(self, message: Message) -> None:
        """Anything else before the peer's connect belongs to a session that ended (the
        peer's current session sends its connect first): dropped and counted, the
        session goes on and its handshake completes (invariant 7)."""
        pair = SessionPair(start=False)
        pair.a.session.start(pair.clock.now)
        pair.b.session.start(pair.clock.now)
        inject(pair, pair.a, message)
        pair.poll()
        assert pair.a.closed is None
        assert kinds(pair.a) == [Connect]
        assert pair.a.session.statistics().stale_frames == 1
        pair.pump()
        assert pair.a.session.ready
        assert pair.b.session.ready
        assert pair.a.closed is None
        assert pair.b.closed is None

    def test_stragglers_do_not_count_as_hearing_the_peer(self) -> None:
        """A request waiting on a peer that never sent its connect gives it up after
        ``peer_wait_s`` however many stragglers arrive (a hostile peer cannot stretch
        the wait to the handshake timeout with them)."""
        pair = SessionPair(start=False)
        pair.a.session.start(pair.clock.now)
        wait = pair.settings.peer_wait_s
        pair.a.session.register_probe("r", b"k", pair.clock.now)
        for _ in range(8):
            pair.clock.advance(wait / 8)
            inject(pair, pair.a, AbortFetch(kv_request_id="r", round_seq=0))
            pair.poll()
        assert closed(pair.a).kind is CloseKind.UNREACHABLE

    def test_disconnect_first_closes_as_disconnected(self) -> None:
        """A goodbye before the peer's connect is a plain disconnect, not an error."""
        pair = SessionPair(start=False)
        pair.a.session.start(pair.clock.now)
        inject(pair, pair.a, Disconnect(reason="going away"))
        pair.poll()
        result = closed(pair.a)
        assert result.kind is CloseKind.DISCONNECTED
        assert "going away" in result.reason
        assert kinds(pair.a) == [Connect]


MALFORMED: dict[str, bytes] = {
    "garbage": b"\xc1\xff\x00garbage",
    "empty": b"",
    "non-map": msgspec.msgpack.encode(["fetch", "r"]),
    "no-type": msgspec.msgpack.encode({"kv_request_id": "r"}),
    "fetch-mismatched-lengths": msgspec.msgpack.encode(
        {
            "type": "fetch",
            "kv_request_id": "r",
            "keys": [b"k1", b"k2"],
            "block_indexes": [1],
            "round_seq": 0,
        }
    ),
    "bool-round-seq": msgspec.msgpack.encode(
        {"type": "lookup", "kv_request_id": "r", "keys": [b"k"], "round_seq": True}
    ),
    "oversized-key": msgspec.msgpack.encode(
        {"type": "lookup", "kv_request_id": "r", "keys": [b"k" * 257], "round_seq": 0}
    ),
    "transfer-done-without-id": msgspec.msgpack.encode(
        {"type": "transfer_done", "success": True, "round_seq": 0}
    ),
}


class TestMalformedFrames:
    """A frame that fails decoding or validation ends that session only."""

    @INITIATORS
    @pytest.mark.parametrize("frame", MALFORMED.values(), ids=MALFORMED.keys())
    def test_malformed_frame_ends_only_the_receiving_session(
        self, first: str, frame: bytes
    ) -> None:
        """PROTOCOL_ERROR, a disconnect with the reason, failed jobs; no exception escapes."""
        pair = connected(first)
        load = pair.next_job_id()
        pair.a.session.request_blocks(load, "pd", [b"wanted"], [2], pair.clock.now)
        pair.pump()
        inject(pair, pair.a, frame)
        assert_protocol_error_isolated(pair, pair.a, pair.b)
        assert not pair.a.loads[load].success
        assert closed(pair.a).failed_request_ids == ("pd",)


class TestUnknownMessages:
    """Unknown message types are counted and ignored (forward compatibility)."""

    def test_unknown_type_is_counted_and_the_session_keeps_working(self) -> None:
        """The session stays up, answers nothing, and a later PD fetch succeeds."""
        pair = connected()
        frame = msgspec.msgpack.encode({"type": "telemetry_v9", "payload": [1, 2, 3]})
        before = len(pair.a.sent())
        inject(pair, pair.a, frame)
        inject(pair, pair.a, frame)
        pair.poll()
        stats = pair.a.session.statistics()
        assert stats.unknown_messages == 2
        assert (stats.ready, stats.closed) == (True, False)
        assert len(pair.a.sent()) == before
        pd_fetch(pair, "after-unknown", [b"k1", b"k2"], [7, 8])
        assert pair.a.closed is None
        assert pair.b.closed is None

    def test_a_routers_messages_inside_a_session_are_counted_and_ignored(self) -> None:
        """A peer that sends ``prefetch`` or ``prefetch_refused`` on its session (they
        belong to a router and a node, outside sessions) gets nothing from it."""
        pair = connected()
        before = len(pair.a.sent())
        inject(pair, pair.a, Prefetch(kv_request_id="x", source="10.0.0.1:1", tokens=(1,)))
        inject(pair, pair.a, PrefetchRefused(kv_request_id="x", reason="no"))
        pair.poll()
        stats = pair.a.session.statistics()
        assert stats.unknown_messages == 2
        assert (stats.ready, stats.closed) == (True, False)
        assert len(pair.a.sent()) == before


class TestFetchValidation:
    """Fetches are checked before any transfer starts."""

    def test_index_at_the_peers_region_end_is_a_protocol_error(self) -> None:
        """Index == the peer's num_blocks ends the session; the last slot is fine."""
        pair = connected(num_blocks=16)
        pd_fetch(pair, "edge", [b"last"], [15])
        inject(
            pair,
            pair.b,
            Fetch(kv_request_id="far", keys=(b"k",), block_indexes=(16,), round_seq=0),
        )
        reason = assert_protocol_error_isolated(pair, pair.b, pair.a)
        assert "16" in reason
        assert pair.b.plane.writes_started == 1

    def test_index_is_checked_against_the_peers_advertised_region(self) -> None:
        """A peer advertising 16 blocks cannot be sent index 16, though we have 64."""
        fabric = Fabric()
        region_a, region_b = Region(16, 32), Region(64, 32)
        FakeDataPlane(fabric, "a", region_a)
        plane_b = FakeDataPlane(fabric, "b", region_b)
        frames: list[bytes] = []

        def transmit(frame: bytes) -> bool:
            frames.append(frame)
            return True

        session = PeerSession("a", make_hello("b", region_b), plane_b, transmit)
        session.start(0.0)
        session.receive(CODEC.encode(make_hello("a", region_a)), 0.0)
        session.receive(CODEC.encode(ConnectAck(peer_id="a")), 0.0)
        assert session.ready
        bad = Fetch(kv_request_id="r", keys=(b"k",), block_indexes=(16,), round_seq=0)
        session.receive(CODEC.encode(bad), 0.0)
        result = session.poll(0.0).closed
        assert result is not None
        assert result.kind is CloseKind.PROTOCOL_ERROR
        goodbye = CODEC.decode(frames[-1])
        assert isinstance(goodbye, Disconnect)
        assert plane_b.writes_started == 0

    def test_second_fetch_for_a_round_with_demand_is_a_protocol_error(self) -> None:
        """A repeated fetch for the same (id, round) ends the producer's session."""
        pair = connected()
        load = pair.next_job_id()
        pair.a.session.request_blocks(load, "pd", [b"wanted"], [3], pair.clock.now)
        pair.pump()
        (fetch,) = sent(pair.a, Fetch)
        inject(pair, pair.b, fetch)
        reason = assert_protocol_error_isolated(pair, pair.b, pair.a)
        assert "second fetch" in reason
        assert not pair.a.loads[load].success

    def test_fetch_with_duplicate_keys_is_a_protocol_error(self) -> None:
        """One key demanded into two slots ends the session before any write."""
        pair = connected()
        pair.b.parent.put(b"dup")
        pair.b.session.add_supply("pd", pair.b.parent.store_job([b"dup"]), pair.clock.now)
        inject(
            pair,
            pair.b,
            Fetch(kv_request_id="pd", keys=(b"dup", b"dup"), block_indexes=(1, 2), round_seq=0),
        )
        reason = assert_protocol_error_isolated(pair, pair.b, pair.a)
        assert "duplicate" in reason
        assert pair.b.plane.writes_started == 0
        assert pair.b.parent.pinned_slots() == 0


class TestClose:
    """Closing reports every held job exactly once, on the next poll."""

    def test_close_reports_everything_the_session_held_once(self) -> None:
        """Failed loads, stores, unresolved ids and owed serves; then closed=None."""
        pair = connected()
        a, b = pair.a, pair.b
        now = pair.clock.now
        # a as consumer: a load in flight, one answered and one unanswered probe.
        load = pair.next_job_id()
        a.session.request_blocks(load, "loading", [b"wanted"], [3], now)
        a.session.register_probe("answered", b"absent", now)
        a.session.flush_lookups()
        pair.pump()
        b.session.serve(b.parent, now)
        pair.pump()
        assert a.session.register_probe("answered", b"absent", now) is False
        a.session.register_probe("probing", b"unknown", now)
        a.session.flush_lookups()
        # a as producer: a parked store, a store being written, a lookup pin,
        # and a lookup waiting (RETRY) inside a serve window.
        for key in (b"parked", b"writing", b"pinned"):
            a.parent.put(key)
        parked = a.parent.store_job([b"parked"])
        a.session.add_supply("parked", parked, now)
        writing = a.parent.store_job([b"writing"])
        a.session.add_supply("writing", writing, now)
        b.session.request_blocks(pair.next_job_id(), "writing", [b"writing"], [9], now)
        b.session.register_probe("pinning", b"pinned", now)
        b.session.register_probe("waiting", b"undecided", now)
        b.session.flush_lookups()
        a.parent.undecided.add(b"undecided")
        pair.deliver()
        a.session.serve(a.parent, now)
        pair.pump()
        assert len(a.plane.pending) == 1
        assert len(a.parent.open_jobs) == 3
        assert len(a.parent.open_requests) == 1
        assert a.session.has_work()

        a.session.close()
        assert a.closed is None  # reported by the poll, not by close()
        polled = a.record(a.session.poll(now))  # also settles pins and serves in the parent
        result = polled.closed
        assert result is not None
        assert polled.loads == ()
        assert polled.stores == ()
        for reported in (result.loads, result.stores):
            assert all(not job.success for job in reported)
        assert [job.job_id for job in result.loads] == [load]
        assert sorted(s.job_id for s in result.stores) == sorted(a.parent.finished_jobs)
        assert len(result.stores) == 3
        assert sorted(result.failed_request_ids) == ["loading", "probing"]
        assert [s.kv_request_id for s in result.unreleased_serves] == ["waiting"]
        assert result.kind is CloseKind.LOCAL
        again = a.session.poll(pair.clock.advance(1.0))
        assert again.closed is None
        assert again.is_empty()
        assert not a.session.has_work()
        assert a.parent.pinned_slots() == 0
        assert a.parent.open_requests == {}
        assert a.plane.pending == {}
        assert a.plane.registered_peers() == []

    def test_close_is_reported_to_the_harness_once_and_releases_the_parent(self) -> None:
        """Through the harness: pins and serve requests are all released after one poll."""
        pair = connected()
        pair.a.parent.put(b"held")
        store = pair.a.parent.store_job([b"held"])
        pair.a.session.add_supply("held", store, pair.clock.now)
        pair.b.session.register_probe("waiting", b"undecided", pair.clock.now)
        pair.b.session.flush_lookups()
        pair.a.parent.undecided.add(b"undecided")
        pair.deliver()
        pair.a.session.serve(pair.a.parent, pair.clock.now)
        pair.a.session.close("shutting down")
        pair.poll()
        assert closed(pair.a).reason == "shutting down"
        assert not pair.a.stores[store.job_id].success
        assert pair.a.parent.pinned_slots() == 0
        assert pair.a.parent.open_requests == {}
        assert sent(pair.a, Disconnect)[-1].reason == "shutting down"
        pair.pump()
        assert closed(pair.b).kind is CloseKind.DISCONNECTED

    def test_frames_after_close_are_ignored(self) -> None:
        """A closed session neither counts, answers nor raises on later frames."""
        pair = connected()
        pair.a.session.close()
        pair.poll()
        stats = pair.a.session.statistics()
        before = len(pair.a.sent())
        for frame in (
            b"\xc1garbage",
            CODEC.encode(Lookup(kv_request_id="r", keys=(b"k",), round_seq=0)),
            CODEC.encode(make_hello("b", pair.b.region)),
        ):
            inject(pair, pair.a, frame)
        pair.poll()
        assert pair.a.session.statistics().frames_received == stats.frames_received
        assert len(pair.a.sent()) == before
        assert pair.a.session.poll(pair.clock.now).is_empty()

    def test_refused_transmit_ends_session_unreachable(self) -> None:
        """A frame the link refuses ends the session; loads already sent fail too."""
        pair = connected()
        first = pair.next_job_id()
        pair.a.session.request_blocks(first, "one", [b"k1"], [1], pair.clock.now)
        pair.pump()
        pair.link.a_to_b.refuse = True
        second = pair.next_job_id()
        pair.a.session.request_blocks(second, "two", [b"k2"], [2], pair.clock.now)
        pair.poll()
        result = closed(pair.a)
        assert result.kind is CloseKind.UNREACHABLE
        assert sorted(job.job_id for job in result.loads) == [first, second]
        assert not pair.a.loads[first].success
        assert not pair.a.loads[second].success

    def test_a_link_that_gave_up_on_an_unread_peer_ends_the_session_over_budget(
        self,
    ) -> None:
        """The link refuses a frame because the peer does not read what we send (its
        ``unread`` says so): the peer broke its budget, and the session says that,
        not that the peer is unreachable (issue 30, item 4)."""
        pair = connected()
        load = pair.next_job_id()
        pair.a.session.request_blocks(load, "one", [b"k1"], [1], pair.clock.now)
        pair.pump()
        pair.link.a_to_b.refuse = True
        pair.link.a_to_b.unread = "the peer does not read: more than 4 frames wait for it"
        second = pair.next_job_id()
        pair.a.session.request_blocks(second, "two", [b"k2"], [2], pair.clock.now)
        pair.poll()
        result = closed(pair.a)
        assert result.kind is CloseKind.OVER_BUDGET
        assert result.reason == "the peer does not read: more than 4 frames wait for it"
        assert sorted(job.job_id for job in result.loads) == [load, second]

    def test_refused_timer_frame_ends_session_unreachable(self) -> None:
        """An abort_fetch the link refuses at the load timeout ends the session at once."""
        pair = connected()
        load = pair.next_job_id()
        pair.a.session.request_blocks(load, "slow", [b"k"], [1], pair.clock.now)
        pair.pump()
        pair.link.a_to_b.refuse = True
        pair.advance(pair.settings.load_timeout_s)
        pair.poll()
        assert closed(pair.a).kind is CloseKind.UNREACHABLE
        assert not pair.a.loads[load].success
        assert AbortFetch not in kinds(pair.a)

    def test_request_blocks_on_a_closed_session_fails_once(self) -> None:
        """A load submitted after close is reported failed on the next poll, once."""
        pair = connected()
        pair.a.session.close()
        pair.poll()
        load = pair.next_job_id()
        pair.a.session.request_blocks(load, "late", [b"k"], [1], pair.clock.now)
        assert pair.a.session.has_work()
        result = pair.a.session.poll(pair.clock.now)
        assert [(r.job_id, r.success) for r in result.loads] == [(load, False)]
        assert result.closed is None
        assert pair.a.session.poll(pair.clock.now).is_empty()
        assert not pair.a.session.has_work()


class TestWorkAndTimers:
    """has_work(), needs_serve() and next_deadline() follow what is outstanding."""

    def test_idle_after_handshake(self) -> None:
        """No work, no serve needed, no deadline."""
        pair = connected()
        for node in (pair.a, pair.b):
            assert not node.session.has_work()
            assert not node.session.needs_serve()
            assert node.session.next_deadline() is None

    def test_load_in_flight_is_work_until_it_completes(self) -> None:
        """A consumer with a load in flight has work; after completion it is idle."""
        pair = connected()
        load = pair.next_job_id()
        pair.a.session.request_blocks(load, "pd", [b"k"], [1], pair.clock.now)
        assert pair.a.session.has_work()
        assert not pair.a.session.needs_serve()
        pair.pump()
        pair.b.parent.put(b"k")
        pair.b.session.add_supply("pd", pair.b.parent.store_job([b"k"]), pair.clock.now)
        assert len(pair.b.plane.pending) == 1
        assert pair.b.session.has_work()  # a write in flight
        assert not pair.b.session.needs_serve()
        pair.b.plane.complete_all()
        pair.pump()
        assert pair.a.loads[load].success
        for node in (pair.a, pair.b):
            assert not node.session.has_work()
            assert node.session.next_deadline() is None

    def test_lookup_waiting_for_serve_needs_a_serve_window(self) -> None:
        """An inbound lookup makes the producer need serve until it is answered."""
        pair = connected()
        pair.a.session.register_probe("sym", b"k", pair.clock.now)
        assert pair.a.session.has_work()  # a probe to flush
        pair.a.session.flush_lookups()
        pair.pump()
        assert pair.b.session.needs_serve()
        assert pair.b.session.has_work()
        pair.serve()
        pair.pump()
        assert not pair.b.session.needs_serve()
        assert not pair.b.session.has_work()

    def test_next_deadline_is_the_earliest_timer(self) -> None:
        """Load and store timeouts: next_deadline() is the earliest, whatever the order."""
        # A silent peer is not given up here (peer_wait_s): the role timers are the subject.
        settings = SessionSettings(load_timeout_s=30.0, store_timeout_s=10.0, peer_wait_s=1e6)
        pair = connected(settings=settings)
        t0 = pair.clock.now
        pair.a.session.request_blocks(pair.next_job_id(), "pd", [b"k"], [1], t0)
        assert pair.a.session.next_deadline() == t0 + 30.0
        pair.advance(5.0)
        pair.a.parent.put(b"s")
        pair.a.session.add_supply("s", pair.a.parent.store_job([b"s"]), pair.clock.now)
        assert pair.a.session.next_deadline() == t0 + 15.0
        pair.advance(10.0)
        pair.pump()  # the store timeout fires and unpins
        assert pair.a.parent.pinned_slots() == 0
        assert pair.a.session.next_deadline() == t0 + 30.0
