"""PeerSession handshake: connect/ack, gating, rejections, deadline and restarts.

Pins docs/protocol.md section 3 and invariants 1-4 of ``kvpeer.session.peer``, after
vLLM's TestConnectHandshake scenarios. Two-party behaviour runs with either
side initiating: the initiator starts alone, the responder starts when that
first frame arrives (as a node does for an inbound peer) and handles it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import pytest

from kvpeer.protocol import (
    PROTOCOL_VERSION,
    AckExtension,
    Codec,
    Connect,
    ConnectAck,
    ConnectExtension,
    Disconnect,
    Fetch,
    Lookup,
    Message,
)
from kvpeer.session import CloseKind, PeerSession, SessionSettings
from kvpeer.session.handshake import Phase
from kvpeer.testing import Fabric, FakeDataPlane, Node, Region, SessionPair, make_hello
from kvpeer.testing.steps import closed, kinds, sent

T = TypeVar("T", bound=Message)

CODEC = Codec()
BOOT_A = bytes(range(16))
BOOT_B = bytes(range(16, 32))
INITIATORS = pytest.mark.parametrize("first", ["a", "b"])


def roles(pair: SessionPair, first: str) -> tuple[Node, Node]:
    """(initiator, responder)."""
    return (pair.a, pair.b) if first == "a" else (pair.b, pair.a)


def begin(pair: SessionPair, first: str) -> None:
    """Initiator starts; one second later the responder starts and takes its connect."""
    initiator, responder = roles(pair, first)
    initiator.session.start(pair.clock.now)
    assert kinds(initiator) == [Connect]
    assert responder.sent() == []
    pair.advance(1.0)
    responder.session.start(pair.clock.now)
    responder.session.receive(initiator.outbox.in_transit.popleft(), pair.clock.now)


def handshake(pair: SessionPair, first: str) -> None:
    begin(pair, first)
    pair.pump()





def advance_to(pair: SessionPair, when: float) -> None:
    pair.advance(when - pair.clock.now)


def with_version(hello: Connect, version: tuple[int, int]) -> Connect:
    assert hello.kvpeer is not None
    return msgspec.structs.replace(
        hello, kvpeer=ConnectExtension(version=version, boot_id=hello.kvpeer.boot_id)
    )


def pair_with(**kwargs: Any) -> SessionPair:
    return SessionPair(start=False, **kwargs)


class TestConnect:
    """Our ``connect`` goes first and describes our region and identity."""

    @INITIATORS
    def test_connect_is_first_frame_and_carries_layout(self, first: str) -> None:
        """Both sides open with a connect holding layout, seed, fingerprint and extension."""
        pair = pair_with(
            num_blocks=32,
            block_len=128,
            hello_a=lambda r: make_hello("a", r, hash_seed="seed-7", fingerprint="fp-1"),
            hello_b=lambda r: make_hello("b", r, hash_seed="seed-7", fingerprint="fp-1"),
        )
        handshake(pair, first)
        boot_ids = set()
        for node in (pair.a, pair.b):
            hello = node.sent()[0]
            assert isinstance(hello, Connect)
            assert (hello.peer_id, hello.num_blocks, hello.block_len) == (node.node_id, 32, 128)
            assert hello.base_addr == 0
            assert (hello.hash_seed, hello.config_fingerprint) == ("seed-7", "fp-1")
            assert hello.kvpeer is not None
            assert hello.kvpeer.version == PROTOCOL_VERSION
            assert len(hello.kvpeer.boot_id) == 16
            boot_ids.add(hello.kvpeer.boot_id)
            raw = msgspec.msgpack.decode(node.outbox.log[0])
            assert raw["type"] == "connect"
            assert raw["kvpeer"]["version"] == list(PROTOCOL_VERSION)
        assert len(boot_ids) == 2

    def test_only_connect_goes_out_until_the_peer_answers(self) -> None:
        """A started session sends its connect and nothing else; it is not ready."""
        pair = pair_with()
        pair.a.session.start(pair.clock.now)
        pair.poll()
        assert kinds(pair.a) == [Connect]
        stats = pair.a.session.statistics()
        assert (stats.ready, stats.closed, stats.frames_sent) == (False, False, 1)


class TestAcknowledge:
    """The peer's connect is registered with the data plane, then acknowledged."""

    @INITIATORS
    def test_each_side_acks_once_and_both_become_ready(self, first: str) -> None:
        """connect, connect_ack each way; both registered and ready."""
        pair = pair_with(
            hello_a=lambda r: make_hello("a", r, boot_id=BOOT_A),
            hello_b=lambda r: make_hello("b", r, boot_id=BOOT_B),
        )
        handshake(pair, first)
        for node, peer, peer_boot in ((pair.a, "b", BOOT_B), (pair.b, "a", BOOT_A)):
            assert kinds(node) == [Connect, ConnectAck]
            (ack,) = sent(node, ConnectAck)
            assert ack.peer_id == node.node_id
            assert ack.kvpeer is not None
            assert ack.kvpeer.version == PROTOCOL_VERSION
            assert node.session.ready
            assert node.session.statistics().ready
            assert node.plane.registered_peers() == [peer]
            assert node.session.peer_boot_id == peer_boot
            assert node.closed is None

    def test_peer_is_registered_before_the_ack_is_transmitted(self) -> None:
        """At the moment connect_ack is handed to the link, the peer is registered."""
        fabric = Fabric()
        region_a, region_b = Region(8, 32), Region(8, 32)
        FakeDataPlane(fabric, "a", region_a)
        plane_b = FakeDataPlane(fabric, "b", region_b)
        seen: list[tuple[str, list[str]]] = []

        def transmit(frame: bytes) -> bool:
            message = CODEC.decode(frame)
            seen.append((type(message).__name__, plane_b.registered_peers()))
            return True

        session = PeerSession("a", make_hello("b", region_b), plane_b, transmit)
        session.start(0.0)
        session.receive(CODEC.encode(make_hello("a", region_a)), 0.0)
        assert seen == [("Connect", []), ("ConnectAck", ["a"])]

    @INITIATORS
    def test_vllm_style_connect_is_accepted_and_acked_without_extension(self, first: str) -> None:
        """A connect without ``kvpeer`` is accepted; our ack to it omits the extension."""
        pair = pair_with(hello_b=lambda r: make_hello("b", r, kvpeer=False))
        handshake(pair, first)
        assert pair.a.session.ready
        assert pair.b.session.ready
        (ack_to_b,) = sent(pair.a, ConnectAck)
        assert ack_to_b.kvpeer is None
        assert b"kvpeer" not in pair.a.outbox.log[1]
        (ack_to_a,) = sent(pair.b, ConnectAck)
        assert ack_to_a.kvpeer is not None
        assert pair.a.session.peer_boot_id is None


class TestQueueing:
    """Role messages wait for the peer's ack, then go out in order."""

    @INITIATORS
    def test_messages_before_ack_are_flushed_in_order(self, first: str) -> None:
        """A lookup and a fetch issued before the ack leave, in order, right after it."""
        pair = pair_with()
        initiator, responder = roles(pair, first)
        initiator.session.start(pair.clock.now)
        responder.session.start(pair.clock.now)
        a, b = pair.a, pair.b
        now = pair.clock.now
        assert a.session.register_probe("look", b"probe-key", now) is None
        a.session.flush_lookups()
        load = pair.next_job_id()
        a.session.request_blocks(load, "pd", [b"pd-key"], [5], now)
        assert kinds(a) == [Connect]
        assert a.session.statistics().queued_messages == 2

        pair.pump()
        assert kinds(a) == [Connect, ConnectAck, Lookup, Fetch]
        assert a.session.statistics().queued_messages == 0
        (lookup,) = sent(a, Lookup)
        assert (lookup.kv_request_id, lookup.keys) == ("look", (b"probe-key",))
        (fetch,) = sent(a, Fetch)
        assert (fetch.kv_request_id, fetch.keys, fetch.block_indexes) == ("pd", (b"pd-key",), (5,))

        # The flushed messages work: the lookup is answered, the fetch is served.
        b.parent.put(b"probe-key")
        b.parent.put(b"pd-key")
        pair.serve()
        b.session.add_supply("pd", b.parent.store_job([b"pd-key"]), pair.clock.now)
        pair.pump()
        b.plane.complete_all()
        pair.pump()
        assert a.session.register_probe("look", b"probe-key", pair.clock.now) is True
        assert a.loads[load].success
        assert a.region.block(5) == b.parent.expected(b"pd-key")

    def test_queue_at_its_limit_is_kept(self) -> None:
        """Exactly ``max_queued_messages`` queued messages are held and flushed."""
        pair = pair_with(settings=SessionSettings(max_queued_messages=2))
        pair.a.session.start(pair.clock.now)
        pair.b.session.start(pair.clock.now)
        for request_id in ("r1", "r2"):
            pair.a.session.request_blocks(
                pair.next_job_id(), request_id, [b"k"], [1], pair.clock.now
            )
        pair.pump()
        assert pair.a.closed is None
        assert [f.kv_request_id for f in sent(pair.a, Fetch)] == ["r1", "r2"]

    @INITIATORS
    def test_queue_overflow_ends_session_unreachable(self, first: str) -> None:
        """One message more than ``max_queued_messages`` ends the session; its jobs fail."""
        pair = pair_with(settings=SessionSettings(max_queued_messages=2))
        initiator, responder = roles(pair, first)
        initiator.session.start(pair.clock.now)
        responder.session.start(pair.clock.now)
        loads = [pair.next_job_id() for _ in range(3)]
        for n, load in enumerate(loads):
            pair.a.session.request_blocks(load, f"r{n}", [b"k"], [n], pair.clock.now)
        pair.poll()
        result = closed(pair.a)
        assert result.kind is CloseKind.UNREACHABLE
        assert sorted(f.job_id for f in result.loads) == loads
        assert not any(pair.a.loads[load].success for load in loads)
        assert sorted(result.failed_request_ids) == ["r0", "r1", "r2"]
        assert kinds(pair.a) == [Connect]


class TestRejection:
    """A failed check: disconnect with the reason, no ack, REJECTED; the peer sees DISCONNECTED."""

    @staticmethod
    def assert_rejected(node: Node, reason_part: str) -> str:
        assert ConnectAck not in kinds(node)
        (goodbye,) = sent(node, Disconnect)
        assert reason_part in goodbye.reason
        result = closed(node)
        assert result.kind is CloseKind.REJECTED
        assert result.reason == goodbye.reason
        assert node.plane.registered_peers() == []
        return goodbye.reason

    @staticmethod
    def assert_disconnected(node: Node, reason: str) -> None:
        result = closed(node)
        assert result.kind is CloseKind.DISCONNECTED
        assert reason in result.reason
        assert Disconnect not in kinds(node)
        assert node.plane.registered_peers() == []

    @INITIATORS
    def test_block_len_mismatch(self, first: str) -> None:
        """Different block lengths: each side rejects the other (the check is symmetric)."""
        pair = pair_with(hello_b=lambda r: make_hello("b", Region(r.num_blocks, 128)))
        handshake(pair, first)
        self.assert_rejected(pair.a, "block_len")
        self.assert_rejected(pair.b, "block_len")

    @INITIATORS
    def test_fingerprint_mismatch(self, first: str) -> None:
        """Two non-empty, different fingerprints: rejected on both sides."""
        pair = pair_with(
            hello_a=lambda r: make_hello("a", r, fingerprint="fp-one"),
            hello_b=lambda r: make_hello("b", r, fingerprint="fp-two"),
        )
        handshake(pair, first)
        self.assert_rejected(pair.a, "fingerprint")
        self.assert_rejected(pair.b, "fingerprint")

    @INITIATORS
    @pytest.mark.parametrize(("fp_a", "fp_b"), [("fp-one", ""), ("", "fp-two"), ("fp", "fp")])
    def test_fingerprint_empty_on_one_side_or_equal_is_accepted(
        self, first: str, fp_a: str, fp_b: str
    ) -> None:
        """An empty fingerprint skips the check; equal ones pass it."""
        pair = pair_with(
            hello_a=lambda r: make_hello("a", r, fingerprint=fp_a),
            hello_b=lambda r: make_hello("b", r, fingerprint=fp_b),
        )
        handshake(pair, first)
        assert pair.a.session.ready
        assert pair.b.session.ready

    @INITIATORS
    def test_hash_seed_mismatch_names_pythonhashseed(self, first: str) -> None:
        """Different hash seeds are rejected with a reason pointing at PYTHONHASHSEED."""
        pair = pair_with(
            hello_a=lambda r: make_hello("a", r, hash_seed="seed-1"),
            hello_b=lambda r: make_hello("b", r, hash_seed="seed-2"),
        )
        handshake(pair, first)
        self.assert_rejected(pair.a, "PYTHONHASHSEED")
        self.assert_rejected(pair.b, "PYTHONHASHSEED")

    @INITIATORS
    def test_major_version_mismatch(self, first: str) -> None:
        """A peer speaking another major version is rejected; that peer is disconnected."""
        pair = pair_with(hello_b=lambda r: with_version(make_hello("b", r), (2, 0)))
        handshake(pair, first)
        reason = self.assert_rejected(pair.a, "version")
        self.assert_disconnected(pair.b, reason)

    @INITIATORS
    def test_minor_version_difference_is_accepted(self, first: str) -> None:
        """Same major, other minor version: compatible."""
        major = PROTOCOL_VERSION[0]
        pair = pair_with(hello_b=lambda r: with_version(make_hello("b", r), (major, 7)))
        handshake(pair, first)
        assert pair.a.session.ready
        assert pair.b.session.ready

    @INITIATORS
    def test_admit_callback_reason_rejects(self, first: str) -> None:
        """The admit hook sees the peer's id and connect; its reason rejects the peer."""
        calls: list[tuple[str, str]] = []

        def admit(peer_id: str, hello: Connect) -> str | None:
            calls.append((peer_id, hello.peer_id))
            return "b is not on the allow-list"

        pair = pair_with(admit_a=admit)
        handshake(pair, first)
        assert calls == [("b", "b")]
        reason = self.assert_rejected(pair.a, "b is not on the allow-list")
        self.assert_disconnected(pair.b, reason)

    @INITIATORS
    def test_admit_callback_none_admits(self, first: str) -> None:
        """An admit hook returning None lets the handshake complete."""
        admit: Callable[[str, Connect], str | None] = lambda peer_id, hello: None  # noqa: E731
        pair = pair_with(admit_a=admit, admit_b=admit)
        handshake(pair, first)
        assert pair.a.session.ready
        assert pair.b.session.ready

    @INITIATORS
    def test_data_plane_refusal_rejects(self, first: str) -> None:
        """A data plane that cannot register the peer rejects it; no ack is promised."""
        pair = pair_with()
        pair.a.plane.refuse_peers["b"] = "region not mappable"
        handshake(pair, first)
        reason = self.assert_rejected(pair.a, "region not mappable")
        self.assert_disconnected(pair.b, reason)


class TestHandshakeDeadline:
    """The handshake must finish within ``handshake_timeout_s`` of start()."""

    def test_silent_peer_times_out_exactly_at_deadline(self) -> None:
        """Alive just before the deadline, TIMEOUT at it; next_deadline() names it."""
        pair = pair_with(settings=SessionSettings(handshake_timeout_s=30.0))
        started = pair.clock.now
        pair.a.session.start(started)
        pair.b.session.start(started)  # its frames are never delivered
        deadline = started + 30.0
        assert pair.a.session.next_deadline() == deadline
        advance_to(pair, deadline - 1e-6)
        pair.poll()
        assert pair.a.closed is None
        assert pair.a.session.alive
        advance_to(pair, deadline)
        pair.poll()
        result = closed(pair.a)
        assert result.kind is CloseKind.TIMEOUT
        assert pair.a.session.next_deadline() is None
        (goodbye,) = sent(pair.a, Disconnect)
        assert goodbye.reason == result.reason

    def test_a_load_waits_on_a_silent_peer_only_peer_wait_s(self) -> None:
        """Invariant 4: a load queued for a peer that never answered fails at
        ``peer_wait_s``, not at the handshake deadline, and its fetch never leaves."""
        pair = pair_with()
        started = pair.clock.now
        pair.a.session.start(started)
        load = pair.next_job_id()
        pair.a.session.request_blocks(load, "r", [b"k"], [3], pair.clock.now)
        assert pair.a.session.next_deadline() == started + pair.settings.peer_wait_s
        advance_to(pair, started + pair.settings.peer_wait_s)
        pair.poll()
        assert closed(pair.a).kind is CloseKind.UNREACHABLE
        assert "peer_wait_s" in closed(pair.a).reason
        assert not pair.a.loads[load].success
        assert Fetch not in kinds(pair.a)

    def test_a_greeted_peer_that_never_acks_is_given_up_after_peer_wait_s(self) -> None:
        """A peer whose connect arrived but whose ack never comes (frozen or cut off
        mid-handshake) costs a waiting load ``peer_wait_s`` from its last frame, not
        the handshake deadline (issue 11: a request's budget, not a session timeout)."""
        pair = pair_with()
        started = pair.clock.now
        pair.a.session.start(started)
        pair.b.session.start(started)
        # Only b's connect reaches a; nothing a sends ever reaches b (no ack comes back).
        pair.clock.advance(0.25)
        pair.a.session.receive(pair.link.b_to_a.in_transit.popleft(), pair.clock.now)
        heard = pair.clock.now
        load = pair.next_job_id()
        pair.a.session.request_blocks(load, "r", [b"k"], [3], pair.clock.now)
        assert pair.a.session.next_deadline() == heard + pair.settings.peer_wait_s
        pair.clock.advance(pair.settings.peer_wait_s - 0.01)
        pair.poll()
        assert pair.a.closed is None
        pair.clock.advance(0.01)
        pair.poll()
        assert closed(pair.a).kind is CloseKind.UNREACHABLE
        assert "peer_wait_s" in closed(pair.a).reason
        assert not pair.a.loads[load].success
        assert pair.a.session.statistics().pings_sent == 0  # nothing is sent before the ack

    def test_a_greeted_peer_nobody_waits_on_gets_the_whole_handshake_time(self) -> None:
        """Slow registration is no fault while no request waits: only the handshake
        deadline ends such a session."""
        pair = pair_with()
        started = pair.clock.now
        pair.a.session.start(started)
        pair.b.session.start(started)
        pair.a.session.receive(pair.link.b_to_a.in_transit.popleft(), pair.clock.now)
        advance_to(pair, started + pair.settings.peer_wait_s + 1.0)
        pair.a.record(pair.a.session.poll(pair.clock.now))
        assert pair.a.closed is None
        assert pair.a.session.next_deadline() == started + pair.settings.handshake_timeout_s

    def test_refusing_link_leaves_the_peer_to_time_out(self) -> None:
        """b's link refuses frames: b is unreachable at once, a times out at its deadline."""
        pair = pair_with()
        pair.link.b_to_a.refuse = True
        started = pair.clock.now
        pair.a.session.start(started)
        pair.b.session.start(started)
        pair.pump()
        assert closed(pair.b).kind is CloseKind.UNREACHABLE
        assert pair.a.closed is None
        assert pair.a.session.next_deadline() == started + pair.settings.handshake_timeout_s
        advance_to(pair, started + pair.settings.handshake_timeout_s)
        pair.poll()
        assert closed(pair.a).kind is CloseKind.TIMEOUT

    @INITIATORS
    def test_deadline_runs_from_each_sides_own_start(self, first: str) -> None:
        """The responder, started a second later, expires a second later."""
        pair = pair_with()
        initiator, responder = roles(pair, first)
        t0 = pair.clock.now
        begin(pair, first)  # responder starts at t0 + 1; nothing more is delivered
        timeout = pair.settings.handshake_timeout_s
        assert initiator.session.next_deadline() == t0 + timeout
        assert responder.session.next_deadline() == t0 + 1.0 + timeout
        advance_to(pair, t0 + timeout)
        pair.poll()
        assert closed(initiator).kind is CloseKind.TIMEOUT
        assert responder.closed is None
        advance_to(pair, t0 + 1.0 + timeout)
        pair.poll()
        assert closed(responder).kind is CloseKind.TIMEOUT

    @INITIATORS
    def test_ack_arriving_in_time_completes_the_handshake(self, first: str) -> None:
        """Frames delivered just before the deadline complete it; nothing expires later."""
        pair = pair_with()
        initiator, _ = roles(pair, first)
        t0 = pair.clock.now
        initiator.session.start(t0)
        advance_to(pair, t0 + 0.5)
        roles(pair, first)[1].session.start(pair.clock.now)
        advance_to(pair, t0 + pair.settings.handshake_timeout_s - 1e-6)
        pair.pump()
        assert pair.a.session.ready
        assert pair.b.session.ready
        assert pair.a.session.next_deadline() is None
        assert pair.b.session.next_deadline() is None
        pair.advance(pair.settings.handshake_timeout_s)
        pair.poll()
        assert pair.a.closed is None
        assert pair.b.closed is None

    def test_ack_received_at_the_deadline_before_poll_counts(self) -> None:
        """Frames handled at the deadline, before that poll, complete the handshake."""
        pair = pair_with()
        t0 = pair.clock.now
        pair.a.session.start(t0)
        pair.b.session.start(t0)
        advance_to(pair, t0 + pair.settings.handshake_timeout_s)
        pair.deliver()
        pair.deliver()
        pair.poll()
        assert pair.a.closed is None
        assert pair.b.closed is None
        assert pair.a.session.ready
        assert pair.b.session.ready


class TestRepeatedHandshake:
    """A second connect: restart, the peer's next session, protocol error, or (before our
    ack) the same grant again."""

    @staticmethod
    def busy_pair() -> tuple[SessionPair, int, int]:
        """A ready pair where a holds a load in flight and a pinned store (session 1 each)."""
        pair = SessionPair(
            hello_a=lambda r: make_hello("a", r, boot_id=BOOT_A, session=1),
            hello_b=lambda r: make_hello("b", r, boot_id=BOOT_B, session=1),
        )
        load = pair.next_job_id()
        pair.a.session.request_blocks(load, "pd", [b"wanted"], [4], pair.clock.now)
        pair.a.parent.put(b"offered")
        store = pair.a.parent.store_job([b"offered"])
        pair.a.session.add_supply("served", store, pair.clock.now)
        pair.pump()
        return pair, load, store.job_id

    def test_new_boot_id_closes_as_restarted_and_fails_jobs(self) -> None:
        """The peer came back with a new boot id: RESTARTED, every job fails."""
        pair, load, store = self.busy_pair()
        again = make_hello("b", pair.b.region, boot_id=bytes(16))
        pair.a.session.receive(CODEC.encode(again), pair.clock.now)
        pair.poll()
        result = closed(pair.a)
        assert result.kind is CloseKind.RESTARTED
        assert not pair.a.loads[load].success
        assert not pair.a.stores[store].success
        assert result.failed_request_ids == ("pd",)
        assert pair.a.parent.pinned_slots() == 0

    def test_a_later_session_after_its_ack_renews_this_one(self) -> None:
        """The same boot id and a higher session number after the peer acknowledged us:
        its session that took our connect ended (its goodbye was lost) and this is its
        next one. RENEWED, no goodbye (it would end the peer's new session), every job
        fails, and every id the session held consumer state for is reported failed,
        resolved probes too."""
        pair, load, store = self.busy_pair()
        pair.b.parent.put(b"probed")
        assert pair.a.session.register_probe("sym", b"probed", pair.clock.now) is None
        pair.a.session.flush_lookups()
        pair.pump()
        pair.serve()
        pair.pump()
        assert pair.a.session.register_probe("sym", b"probed", pair.clock.now) is True
        before = len(pair.a.sent())
        again = make_hello("b", pair.b.region, boot_id=BOOT_B, session=2)
        pair.a.session.receive(CODEC.encode(again), pair.clock.now)
        pair.poll()
        result = closed(pair.a)
        assert result.kind is CloseKind.RENEWED
        assert len(pair.a.sent()) == before, "no goodbye, no ack: the owner opens a fresh one"
        assert not pair.a.loads[load].success
        assert not pair.a.stores[store].success
        assert sorted(result.failed_request_ids) == ["pd", "sym"]
        assert pair.a.parent.pinned_slots() == 0
        assert pair.a.plane.registered_peers() == []

    def test_an_older_sessions_connect_is_a_straggler(self) -> None:
        """A lower session number: an ended session's connect, late on another link."""
        pair, load, _ = self.busy_pair()
        again = make_hello("b", pair.b.region, boot_id=BOOT_B, session=0)
        pair.a.session.receive(CODEC.encode(again), pair.clock.now)
        pair.poll()
        assert pair.a.closed is None
        assert pair.a.session.statistics().stale_frames == 1
        assert load not in pair.a.loads  # still in flight, not failed

    @pytest.mark.parametrize("numbered", [True, False], ids=["numbered", "unnumbered"])
    def test_the_same_session_number_again_is_a_duplicate(self, numbered: bool) -> None:
        """The same connect after the handshake (numbered or from an older kvpeer peer
        that numbers nothing): acknowledged again, nothing ends."""
        pair = SessionPair(
            hello_a=lambda r: make_hello("a", r, boot_id=BOOT_A, session=1 if numbered else None),
            hello_b=lambda r: make_hello("b", r, boot_id=BOOT_B, session=1 if numbered else None),
        )
        again = make_hello("b", pair.b.region, boot_id=BOOT_B, session=1 if numbered else None)
        _a_duplicate_connect_ends_the_session(pair, again)

    def test_a_later_session_before_its_ack_is_adopted(self) -> None:
        """Nobody acknowledged our connect yet and the peer's next session greets us:
        our connect goes again (the peer's ended session took the first one; its new
        one would wait for it: seed 25008), then its connect is taken in (checked,
        registered, acknowledged with its number) and the handshake completes with its
        ack; what we queued goes out after it."""
        pair = pair_with()
        a = pair.a
        a.session.start(pair.clock.now)
        first = make_hello("b", pair.b.region, boot_id=BOOT_B, session=5)
        a.session.receive(CODEC.encode(first), pair.clock.now)
        load = pair.next_job_id()
        a.session.request_blocks(load, "pd", [b"wanted"], [4], pair.clock.now)
        assert sent(a, Fetch) == [], "setup: queued until acknowledged"
        later = make_hello("b", pair.b.region, boot_id=BOOT_B, session=6)
        a.session.receive(CODEC.encode(later), pair.clock.now)
        acks = sent(a, ConnectAck)
        assert [ack.kvpeer.session for ack in acks if ack.kvpeer is not None] == [5, 6]
        greeting = [m for m in a.sent() if isinstance(m, (Connect, ConnectAck))]
        assert [type(m) for m in greeting] == [Connect, ConnectAck, Connect, ConnectAck]
        assert greeting[2] == greeting[0], "the same connect: the same session number"
        assert a.session.peer_hello == later
        assert a.plane.registered_peers() == ["b"]
        a.session.receive(CODEC.encode(ConnectAck(peer_id="b")), pair.clock.now)
        pair.poll()
        assert a.closed is None
        assert a.session.ready
        assert len(sent(a, Fetch)) == 1

    def test_the_peers_next_session_completes_with_the_adopter(self) -> None:
        """Seed 25008 between two real sessions: our connect and our ack of the peer's
        session 5 went to that session, which then ended (both lost to it); the peer's
        session 6 greets us. Adopting it sends our connect again, so session 6 gets one
        and both sides are ready at once, not after session 6 waited out its deadline."""
        pair = pair_with(
            hello_a=lambda r: make_hello("a", r, boot_id=BOOT_A, session=1),
            hello_b=lambda r: make_hello("b", r, boot_id=BOOT_B, session=6),
        )
        a = pair.a
        a.session.start(pair.clock.now)
        old = make_hello("b", pair.b.region, boot_id=BOOT_B, session=5)
        a.session.receive(CODEC.encode(old), pair.clock.now)
        pair.link.a_to_b.in_transit.clear()  # read by the peer's ended session 5
        pair.b.session.start(pair.clock.now)
        pair.pump()
        assert a.closed is None
        assert pair.b.closed is None
        assert a.session.ready
        assert pair.b.session.ready

    def test_an_ack_for_another_session_number_is_a_straggler(self) -> None:
        """An ack echoing another number than our connect's acknowledges one of our ended
        sessions (or another incarnation's): dropped, the handshake waits for ours."""
        pair = SessionPair(
            start=False,
            hello_a=lambda r: make_hello("a", r, boot_id=BOOT_A, session=7),
            hello_b=lambda r: make_hello("b", r, boot_id=BOOT_B, session=1),
        )
        a = pair.a
        a.session.start(pair.clock.now)
        hello = make_hello("b", pair.b.region, boot_id=BOOT_B, session=1)
        a.session.receive(CODEC.encode(hello), pair.clock.now)
        stale = ConnectAck(peer_id="b", kvpeer=AckExtension(version=PROTOCOL_VERSION, session=6))
        a.session.receive(CODEC.encode(stale), pair.clock.now)
        assert not a.session.ready
        assert a.session.statistics().stale_frames == 1
        mine = ConnectAck(peer_id="b", kvpeer=AckExtension(version=PROTOCOL_VERSION, session=7))
        a.session.receive(CODEC.encode(mine), pair.clock.now)
        assert a.session.ready

    def test_a_connect_without_boot_id_after_the_handshake_is_a_duplicate(self) -> None:
        """vLLM's connect carries no boot id: the same one again after the handshake (its
        ack came late) is acknowledged again and nothing ends (docs/protocol.md §3.4)."""
        pair = SessionPair(
            hello_a=lambda r: make_hello("a", r, kvpeer=False),
            hello_b=lambda r: make_hello("b", r, kvpeer=False),
        )
        _a_duplicate_connect_ends_the_session(pair, make_hello("b", pair.b.region, kvpeer=False))
        pair.pump()
        assert pair.b.session.ready

    @pytest.mark.parametrize("kvpeer", [True, False], ids=["kvpeer", "vllm"])
    def test_same_connect_before_our_ack_is_acked_again(self, kvpeer: bool) -> None:
        """The peer started its side over before acknowledging us (vLLM opens a session
        per accepted connection) and sent the same connect: the same ack again, and the
        handshake completes with the ack that follows."""
        pair = pair_with()
        a = pair.a
        a.session.start(pair.clock.now)
        hello = make_hello("b", pair.b.region, boot_id=BOOT_B, kvpeer=kvpeer)
        a.session.receive(CODEC.encode(hello), pair.clock.now)
        a.session.receive(CODEC.encode(hello), pair.clock.now)
        first, again = sent(a, ConnectAck)
        assert again == first
        assert a.plane.registered_peers() == ["b"]
        assert not a.session.ready
        a.session.receive(CODEC.encode(ConnectAck(peer_id="b")), pair.clock.now)
        pair.poll()
        assert a.closed is None
        assert a.session.ready

    def test_different_connect_before_our_ack_is_a_protocol_error(self) -> None:
        """Only the very same connect is granted again: another region is a violation."""
        pair = pair_with()
        a = pair.a
        a.session.start(pair.clock.now)
        hello = make_hello("b", pair.b.region, kvpeer=False)
        a.session.receive(CODEC.encode(hello), pair.clock.now)
        moved = msgspec.structs.replace(hello, base_addr=hello.base_addr + 4096)
        a.session.receive(CODEC.encode(moved), pair.clock.now)
        pair.poll()
        result = closed(a)
        assert result.kind is CloseKind.PROTOCOL_ERROR
        assert "duplicate connect" in result.reason
        assert len(sent(a, ConnectAck)) == 1

    def test_duplicate_connect_ack_is_a_straggler(self) -> None:
        """A second connect_ack acknowledges a connect of an ended session of ours (or is
        a re-grant): dropped and counted; the session and its load go on (invariant 7)."""
        pair, load, _ = self.busy_pair()
        before = len(pair.a.sent())
        pair.a.session.receive(CODEC.encode(ConnectAck(peer_id="b")), pair.clock.now)
        pair.poll()
        assert pair.a.closed is None
        assert len(pair.a.sent()) == before
        assert pair.a.session.statistics().stale_frames == 1
        assert load not in pair.a.loads  # still in flight, not failed


def _a_duplicate_connect_ends_the_session(pair: SessionPair, again: Connect) -> None:
    """With a PD load in flight, the very same connect reaches a's session again after
    the handshake (a peer whose ack came late re-sends it; vLLM's p2p tier does under
    load): the same ack again, the session and its load go on."""
    load = pair.next_job_id()
    pair.a.session.request_blocks(load, "pd", [b"wanted"], [4], pair.clock.now)
    pair.pump()
    acks_before = len(sent(pair.a, ConnectAck))
    pair.a.session.receive(CODEC.encode(again), pair.clock.now)
    pair.poll()
    assert pair.a.session.ready
    assert not sent(pair.a, Disconnect)
    assert len(sent(pair.a, ConnectAck)) == acks_before + 1
    assert load not in pair.a.loads or pair.a.loads[load].success


class TestPhase:
    """The session's phase is one value (``kvpeer.session.handshake.Phase``)."""

    @INITIATORS
    def test_new_greeting_granted_ready_closed(self, first: str) -> None:
        pair = pair_with()
        initiator, responder = roles(pair, first)
        assert phase(initiator) is Phase.NEW
        initiator.session.start(pair.clock.now)
        assert phase(initiator) is Phase.GREETING
        responder.session.start(pair.clock.now)
        responder.session.receive(initiator.outbox.in_transit.popleft(), pair.clock.now)
        assert phase(responder) is Phase.GRANTED  # its ack went; ours is owed
        initiator.session.receive(responder.outbox.in_transit.popleft(), pair.clock.now)
        assert phase(initiator) is Phase.GRANTED  # the responder's connect
        initiator.session.receive(responder.outbox.in_transit.popleft(), pair.clock.now)
        assert phase(initiator) is Phase.READY  # and its ack
        responder.session.receive(initiator.outbox.in_transit.popleft(), pair.clock.now)
        assert phase(responder) is Phase.READY
        responder.session.close()
        assert phase(responder) is Phase.CLOSED
        assert responder.session.answered, "the history outlives the phase"

    def test_an_ack_before_the_peers_connect_moves_nothing(self) -> None:
        pair = pair_with()
        a = pair.a
        a.session.start(pair.clock.now)
        ack = ConnectAck(peer_id="b", kvpeer=AckExtension(version=PROTOCOL_VERSION))
        a.session.receive(CODEC.encode(ack), pair.clock.now)
        assert phase(a) is Phase.GREETING
        assert a.session.statistics().stale_frames == 1


def phase(node: Node) -> Phase:
    return node.session.phase
