"""The peer table driven directly (``kvpeer.node.peertable`` invariants 1-8).

A fake control endpoint records every link it opened, what went out on each
and what was refused; peers are hand-made frames routed in with the source
address a transport would report. Sessions are real (:class:`PeerSession` over
a fake data plane). What reaches the tier is what the table returned (``Polled``
values). The same rules
over a whole cluster are pinned by ``test_tier_sessions.py`` and
``test_tier_goodbye.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest

from kvpeer.config import TierConfig
from kvpeer.errors import PeerLost
from kvpeer.node.counters import TierCounters
from kvpeer.node.peertable import FIRST_RETRY_S, Peer, PeerTable, Polled
from kvpeer.node.registering import MAX_HELD_FRAMES
from kvpeer.protocol import (
    PROTOCOL_VERSION,
    AckExtension,
    Codec,
    Connect,
    ConnectAck,
    Disconnect,
    Message,
    Ping,
    UnknownMessage,
)
from kvpeer.session import CloseKind
from kvpeer.session.greeting import session_number
from kvpeer.testing import Fabric, FakeDataPlane, Region, make_hello
from kvpeer.transport.base import InboundFrame

LOCAL = "10.0.0.1:5710"
BLOCKS, BLOCK_LEN = 16, 64
HANDSHAKE_S = 30.0  # handshake_timeout_s default


def pid(n: int, host: str = "10.0.0.") -> str:
    """Peer ``n``: its own host, so its id names the address it comes from."""
    return f"{host}{n + 10}:5710"


def ip(peer_id: str) -> str:
    return peer_id.rsplit(":", 1)[0]


class FakeLink:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.alive = True
        self.closed = False
        self.parked: bool | None = None  # how it was closed
        self.unread: str | None = None
        self.sent: list[Message | UnknownMessage] = []

    def transmit(self, frame: bytes) -> bool:
        if not self.alive:
            return False  # died (the peer was cut off when we dialled): refused
        self.sent.append(Codec().decode(frame))
        return True

    def close(self, *, park: bool = True) -> None:
        self.closed = True
        self.parked = park


class FakeControl:
    def __init__(self) -> None:
        self.local_id = LOCAL
        self.links: list[FakeLink] = []
        self.refused: list[tuple[str, Message | UnknownMessage]] = []
        self.unreachable: set[str] = set()

    def connect(self, peer_id: str) -> FakeLink:
        if peer_id in self.unreachable:
            raise PeerLost(f"{peer_id} unreachable")
        link = FakeLink(peer_id)
        self.links.append(link)
        return link

    def links_to(self, peer_id: str) -> list[FakeLink]:
        return [link for link in self.links if link.peer_id == peer_id]

    def receive(self) -> list[InboundFrame]:
        return []

    def flush(self) -> None:
        pass

    def refuse(self, peer_id: str, frame: bytes) -> None:
        self.refused.append((peer_id, Codec().decode(frame)))

    def next_deadline(self) -> float | None:
        return None

    def close(self) -> None:
        pass


class SlowPlane(FakeDataPlane):
    """Registers each peer off the lock (invariant 9) until the test says it is done."""

    def __init__(self, fabric: Fabric, node_id: str, region: Region) -> None:
        super().__init__(fabric, node_id, region)
        self.running: set[str] = set()
        self.ready: set[str] = set()
        self.settled: list[str] = []
        self.prepared: list[tuple[str, int | None]] = []  # (peer, its session number)

    def prepare_peer(self, peer_id: str, hello: Connect) -> bool:
        if peer_id in self.ready:
            return True
        self.running.add(peer_id)
        self.prepared.append((peer_id, session_number(hello)))
        return False

    def preparing(self, peer_id: str) -> bool:
        return peer_id in self.running

    def settle_peer(self, peer_id: str) -> None:
        self.settled.append(peer_id)

    def finish(self, peer_id: str) -> None:
        self.running.discard(peer_id)
        self.ready.add(peer_id)

    def forget(self, peer_id: str) -> None:
        """The next connect of ``peer_id`` registers off the lock again."""
        self.ready.discard(peer_id)


class Table:
    """A peer table and everything it did."""

    def __init__(self, config: Mapping[str, object] | None = None, *, slow: bool = False) -> None:
        self.now = 0.0
        self.config = TierConfig.from_dict({"host": "10.0.0.1", "port": 5710, **(config or {})})
        self.fabric = Fabric()
        kind = SlowPlane if slow else FakeDataPlane
        self.plane = kind(self.fabric, LOCAL, Region(BLOCKS, BLOCK_LEN))
        self.control = FakeControl()
        self.counters = TierCounters()
        self.needed: set[str] = set()
        self.closed: list[tuple[str, CloseKind]] = []
        self.table = PeerTable(
            self.config,
            self.control,
            self.plane,
            self.counters,
            pulled_from=lambda: self.needed,
        )
        self._boots: dict[str, bytes] = {}

    def _reaped(self, polled: Iterable[Polled]) -> None:
        for each in polled:
            closed = each.result.closed
            if closed is not None:
                assert self.table.get(each.peer_id) is not each.peer, "dropped already"
                self.closed.append((each.peer_id, closed.kind))

    def open(self, peer_id: str) -> Peer | None:
        peer, polled = self.table.open(peer_id, self.now)
        self._reaped(polled)
        return peer

    def poll(self) -> None:
        self._reaped(list(self.table.poll(self.now)))

    def close_all(self, reason: str) -> None:
        self._reaped(self.table.close_all(reason, self.now))

    def hello(
        self,
        peer_id: str,
        *,
        boot: int = 1,
        block_len: int = BLOCK_LEN,
        session: int | None = None,
    ) -> bytes:
        """The ``connect`` peer ``peer_id`` sends (its region exists in the fabric)."""
        if peer_id not in self.fabric.planes:
            FakeDataPlane(self.fabric, peer_id, Region(BLOCKS, BLOCK_LEN))
        claimed = Region(BLOCKS, block_len)
        hello = make_hello(peer_id, claimed, boot_id=bytes([boot]) * 16, session=session)
        return Codec().encode(hello)

    def frame(self, peer_id: str, frame: bytes, source: str | None = "") -> None:
        """``frame`` arrives from ``peer_id`` (by default from the address it names)."""
        inbound = InboundFrame(peer_id, frame, ip(peer_id) if source == "" else source)
        self._reaped(self.table.route(inbound, self.now))

    def connect_from(self, peer_id: str, source: str | None = "", **hello: int) -> None:
        self.frame(peer_id, self.hello(peer_id, **hello), source)

    def ack_from(self, peer_id: str, source: str | None = "") -> None:
        ack = ConnectAck(peer_id=peer_id, kvpeer=AckExtension(version=PROTOCOL_VERSION))
        self.frame(peer_id, Codec().encode(ack), source)

    def ready(self, peer_id: str) -> Peer:
        """A session with ``peer_id`` whose handshake completed both ways."""
        self.connect_from(peer_id)
        self.ack_from(peer_id)
        peer = self.table.get(peer_id)
        assert peer is not None
        assert peer.session.ready
        return peer

    def has(self, peer_id: str) -> bool:
        peer = self.table.get(peer_id)
        return peer is not None and peer.session.alive

    def refusals_of(self, peer_id: str) -> list[str]:
        return [
            m.reason for p, m in self.control.refused if p == peer_id and isinstance(m, Disconnect)
        ]


@pytest.fixture
def t() -> Table:
    return Table()


class TestOpening:
    def test_open_dials_grants_and_greets(self, t: Table) -> None:
        peer = t.open(pid(1))
        assert peer is not None
        assert peer.session.alive
        (link,) = t.control.links_to(pid(1))
        assert isinstance(link.sent[0], Connect)
        assert link.sent[0].peer_id == LOCAL
        assert pid(1) in t.plane.granted
        assert t.counters.sessions_opened == 1
        assert t.open(pid(1)) is peer  # the live one, not a second
        assert t.table.statistics().sessions == 1

    @pytest.mark.parametrize("peer_id", [LOCAL, "not-an-address", "192.168.0.7:5710"])
    def test_never_dials_ourselves_a_bad_id_or_a_peer_not_allowed(self, peer_id: str) -> None:
        t = Table({"allowed_peers": ["10.0.0.0/8"]})
        assert t.open(peer_id) is None
        assert t.control.links == []
        assert t.table.statistics().peers_refused == 1


class TestInbound:
    """Invariants 1 and 4."""

    def test_a_connect_opens_a_session_that_acknowledges_it(self, t: Table) -> None:
        t.connect_from(pid(1))
        assert t.has(pid(1))
        (link,) = t.control.links_to(pid(1))
        assert [type(m) for m in link.sent] == [Connect, ConnectAck]

    def test_anything_else_from_a_stranger_is_a_stray(self, t: Table) -> None:
        t.frame(pid(1), Codec().encode(Disconnect(reason="bye")))
        t.frame(pid(1), b"garbage")
        assert not t.has(pid(1))
        assert t.control.links == []
        assert t.control.refused == []
        assert t.table.statistics().stray_frames == 2

    def test_frames_under_our_own_identity_are_dropped(self, t: Table) -> None:
        t.connect_from(LOCAL)
        assert t.control.links == []
        assert t.table.statistics().stray_frames == 1

    def test_a_source_outside_the_allow_list_is_refused_on_its_own_connection(self) -> None:
        t = Table({"allowed_peers": ["10.0.0.0/8"]})
        t.connect_from("192.168.0.7:5710")
        assert t.control.links == []  # never dialed
        assert "not in allowed_peers" in t.refusals_of("192.168.0.7:5710")[0]
        assert t.table.statistics().peers_refused == 1

    def test_a_goodbye_is_never_answered_with_a_refusal(self) -> None:
        t = Table({"allowed_peers": ["10.0.0.0/8"]})
        t.frame("192.168.0.7:5710", Codec().encode(Disconnect(reason="bye")))
        assert t.control.refused == []

    def test_an_id_that_does_not_name_its_source_is_refused(self, t: Table) -> None:
        t.connect_from(pid(1), source="10.9.9.9")
        assert not t.has(pid(1))
        assert t.control.links == []
        assert "does not name the address" in t.refusals_of(pid(1))[0]

    def test_trusted_addresses_may_differ_from_their_source(self) -> None:
        t = Table({"trust_peer_addresses": True})
        t.connect_from(pid(1), source="10.9.9.9")
        assert t.has(pid(1))

    def test_ipv4_mapped_sources_count_as_ipv4(self, t: Table) -> None:
        t.connect_from(pid(1), source=f"::ffff:{ip(pid(1))}")
        assert t.has(pid(1))

    def test_a_session_is_bound_to_its_first_source(self) -> None:
        t = Table({"trust_peer_addresses": True})
        t.connect_from(pid(1), source="10.9.9.9")
        t.frame(pid(1), Codec().encode(Disconnect(reason="fake")), source="10.8.8.8")
        assert t.has(pid(1))  # the impostor's goodbye was dropped
        assert t.table.statistics().stray_frames == 1

    def test_a_transport_that_cannot_tell_the_source_is_not_checked(self, t: Table) -> None:
        t.connect_from(pid(1), source=None)
        assert t.has(pid(1))

    def test_handshakes_per_source_are_capped(self) -> None:
        t = Table({"trust_peer_addresses": True, "max_handshakes_per_source": 2})
        for n in range(3):
            t.connect_from(pid(n), source="10.9.9.9")
        assert [t.has(pid(n)) for n in range(3)] == [True, True, False]
        assert "max_handshakes_per_source" in t.refusals_of(pid(2))[0]
        t.ack_from(pid(0), source="10.9.9.9")  # one completes its handshake: room for another
        t.connect_from(pid(2), source="10.9.9.9")
        assert t.has(pid(2))


class TestCapAndEviction:
    """Invariants 5 and 6."""

    def test_the_least_recently_used_handshaking_session_makes_room(self) -> None:
        t = Table({"max_peers": 2})
        t.open(pid(1))
        t.now = 1.0
        t.open(pid(2))
        t.now = 2.0
        assert t.open(pid(3)) is not None
        assert t.closed == [(pid(1), CloseKind.LOCAL)]
        assert (t.has(pid(1)), t.has(pid(2)), t.has(pid(3))) == (False, True, True)
        assert pid(1) not in t.plane.granted  # revoked with its session
        assert t.control.links_to(pid(1))[0].closed

    def test_a_handshaking_session_goes_before_a_ready_one(self) -> None:
        t = Table({"max_peers": 2})
        t.open(pid(1))
        t.now = 1.0
        t.ready(pid(2))
        t.now = 2.0
        t.open(pid(3))
        assert [peer for peer, _ in t.closed] == [pid(1)]

    def test_a_ready_session_a_live_request_pulls_from_is_kept(self) -> None:
        t = Table({"max_peers": 2})
        t.ready(pid(1))
        t.ready(pid(2))
        t.needed = {pid(1), pid(2)}
        assert t.open(pid(3)) is None
        assert t.closed == []
        assert t.table.statistics().peers_refused == 1
        t.needed = {pid(2)}
        assert t.open(pid(3)) is not None
        assert [peer for peer, _ in t.closed] == [pid(1)]

    def test_the_busiest_source_loses_its_handshakes_first(self) -> None:
        t = Table({"max_peers": 3, "trust_peer_addresses": True})
        t.connect_from(pid(1), source="10.7.7.7")  # the oldest, alone on its source
        t.now = 1.0
        t.connect_from(pid(2), source="10.9.9.9")
        t.connect_from(pid(3), source="10.9.9.9")
        t.now = 2.0
        t.open(pid(4))
        assert [peer for peer, _ in t.closed] == [pid(2)]

    def test_an_inbound_peer_beyond_the_cap_is_refused_when_nobody_is_idle(self) -> None:
        t = Table({"max_peers": 1})
        t.ready(pid(1))
        t.needed = {pid(1)}
        t.connect_from(pid(2))
        assert not t.has(pid(2))
        assert "peer cap" in t.refusals_of(pid(2))[0]


class TestRefusedHellos:
    """Invariant 3: a refused connect is refused again without a session."""

    def rejected(self, t: Table, peer_id: str) -> None:
        t.connect_from(peer_id, block_len=BLOCK_LEN * 2)  # incompatible: REJECTED
        assert (peer_id, CloseKind.REJECTED) in t.closed

    def test_the_same_connect_is_refused_without_opening_a_session(self, t: Table) -> None:
        self.rejected(t, pid(1))
        links = len(t.control.links)
        t.now = HANDSHAKE_S - 1
        t.connect_from(pid(1), block_len=BLOCK_LEN * 2)
        assert len(t.control.links) == links  # nobody dialed, no session
        assert "refused before" in t.refusals_of(pid(1))[-1]
        assert t.table.statistics().refusals_remembered == 1

    def test_a_different_connect_opens_a_session(self, t: Table) -> None:
        self.rejected(t, pid(1))
        t.connect_from(pid(1))  # a compatible one
        assert t.has(pid(1))

    def test_the_memory_expires_after_the_handshake_timeout(self, t: Table) -> None:
        self.rejected(t, pid(1))
        t.table.expire(HANDSHAKE_S - 0.1)
        assert t.table.statistics().refusals_remembered == 1
        t.now = HANDSHAKE_S
        t.table.expire(t.now)
        assert t.table.statistics().refusals_remembered == 0
        links = len(t.control.links)
        t.connect_from(pid(1), block_len=BLOCK_LEN * 2)
        assert len(t.control.links) == links + 1  # a session tried (and refused) again

    def test_at_most_max_peers_refusals_are_remembered(self) -> None:
        t = Table({"max_peers": 2})
        for n in range(3):
            self.rejected(t, pid(n))
        assert t.table.statistics().refusals_remembered == 2
        links = len(t.control.links)
        t.connect_from(pid(0), block_len=BLOCK_LEN * 2)  # the oldest was forgotten
        assert len(t.control.links) == links + 1


class TestEnding:
    """Invariants 2 and 7: goodbye on a fresh link, back-off of the unreachable."""

    def test_a_broken_link_ends_the_session_and_we_say_goodbye_on_a_fresh_one(
        self, t: Table
    ) -> None:
        t.ready(pid(1))
        old = t.control.links_to(pid(1))[0]
        old.alive = False
        t.poll()
        assert t.closed == [(pid(1), CloseKind.UNREACHABLE)]
        assert old.closed
        goodbye = t.control.links_to(pid(1))[-1]
        assert goodbye is not old
        assert goodbye.closed
        assert [type(m) for m in goodbye.sent] == [Disconnect]
        assert not t.table.backed_off(pid(1), t.now)  # it answered once: no back-off

    def test_no_goodbye_when_the_peer_cannot_be_dialed(self, t: Table) -> None:
        t.ready(pid(1))
        t.control.links_to(pid(1))[0].alive = False
        t.control.unreachable.add(pid(1))
        t.poll()  # PeerLost is swallowed
        assert len(t.control.links_to(pid(1))) == 1

    def test_a_peer_that_never_answered_is_backed_off_doubling(self) -> None:
        t = Table({"peer_retry_max_s": 3.0})
        for delay in (FIRST_RETRY_S, 2 * FIRST_RETRY_S, 3.0, 3.0):
            t.open(pid(1))
            t.control.links_to(pid(1))[-1].alive = False
            t.poll()
            assert t.table.backed_off(pid(1), t.now + delay - 0.01)
            assert not t.table.backed_off(pid(1), t.now + delay)
            t.now += delay
        assert len(t.control.links_to(pid(1))) == 4  # no goodbyes: nobody to hear them

    def test_a_peer_that_answers_clears_its_back_off(self, t: Table) -> None:
        t.open(pid(1))
        t.control.links_to(pid(1))[-1].alive = False
        t.poll()
        assert t.table.statistics().backed_off == 1
        t.ready(pid(1))  # it came back and connected to us
        assert not t.table.backed_off(pid(1), t.now)
        assert t.table.statistics().backed_off == 0

    def test_back_offs_remembered_are_bounded(self) -> None:
        t = Table({"max_peers": 1})
        for n in range(6):
            t.open(pid(n))
            t.control.links_to(pid(n))[-1].alive = False
            t.poll()
        assert t.table.statistics().backed_off == 4
        assert not t.table.backed_off(pid(0), t.now)  # the oldest were forgotten

    def test_close_all_ends_every_session(self, t: Table) -> None:
        t.ready(pid(1))
        t.open(pid(2))
        t.close_all("tier shutting down")
        assert sorted(peer for peer, _ in t.closed) == [pid(1), pid(2)]
        assert len(t.table) == 0
        assert t.plane.granted == set()


class TestRestart:
    """Invariant 8: a new boot id ends the old session and opens a fresh one."""

    def test_a_new_boot_id_opens_a_fresh_session_with_the_same_connect(self, t: Table) -> None:
        old = t.ready(pid(1))
        t.connect_from(pid(1), boot=2)
        assert t.closed == [(pid(1), CloseKind.RESTARTED)]
        fresh = t.table.get(pid(1))
        assert fresh is not None
        assert fresh is not old
        assert fresh.session.alive
        new_link = t.control.links_to(pid(1))[-1]
        assert [type(m) for m in new_link.sent] == [Connect, ConnectAck]
        assert t.counters.sessions_opened == 2

    def test_a_connect_our_dead_link_cannot_answer_opens_a_fresh_session(
        self, t: Table
    ) -> None:
        """Seed 30771: our session toward the peer was opened while the path was cut and
        its link died; the peer's connect arrives once the path healed, the answer is
        refused, and the session ends unreachable. The connect proves the peer is there:
        a fresh session on a new link answers it (dropped, the peer's session waited for
        a connect that had gone to this one, until both gave up on a healthy path)."""
        old = t.open(pid(1))
        assert old is not None
        (dead,) = t.control.links_to(pid(1))
        dead.alive = False
        t.connect_from(pid(1))
        assert t.closed == [(pid(1), CloseKind.UNREACHABLE)]
        fresh = t.table.get(pid(1))
        assert fresh is not None
        assert fresh is not old
        hello = fresh.session.peer_hello
        assert hello is not None
        assert hello.peer_id == pid(1)
        new_link = t.control.links_to(pid(1))[-1]
        assert new_link is not dead
        assert [type(m) for m in new_link.sent] == [Connect, ConnectAck]
        t.ack_from(pid(1))
        assert fresh.session.ready
        assert not t.table.backed_off(pid(1), t.now), "a session that completed clears it"

    def test_a_restarted_peers_old_connection_is_not_kept(self, t: Table) -> None:
        """A new boot id: the old link's connection went to the old process, so the
        fresh session dials afresh instead of taking it over (CI's restarted-producer
        fault took 0.27-0.30 s instead of tens of ms when it was kept)."""
        t.ready(pid(1))
        t.connect_from(pid(1), boot=2)
        assert t.closed == [(pid(1), CloseKind.RESTARTED)]
        old, fresh = t.control.links_to(pid(1))
        assert old.parked is False
        assert fresh.parked is None  # open

    @pytest.mark.parametrize("kind", [CloseKind.UNREACHABLE, CloseKind.TIMEOUT])
    def test_nothing_is_kept_toward_a_peer_that_fell_silent(
        self, t: Table, kind: CloseKind
    ) -> None:
        """A session that ends because the peer went silent closes its link without
        parking its connection, and its goodbye link too: none is kept toward a peer
        that may be gone (a partition test found one left for 10 s)."""
        peer = t.ready(pid(1))
        peer.session.close("the peer went quiet", kind)
        t.poll()
        links = t.control.links_to(pid(1))
        assert links[0].parked is False
        assert all(link.parked is False for link in links[1:])  # the goodbye's, if any

    def test_a_renewed_session_parks_its_link_for_the_next(self, t: Table) -> None:
        """The peer is there (its next session greets us): the connection is kept."""
        t.connect_from(pid(1), session=5)
        t.ack_from(pid(1))
        t.connect_from(pid(1), session=6)
        assert t.closed == [(pid(1), CloseKind.RENEWED)]
        assert t.control.links_to(pid(1))[0].parked is True

    def test_a_frame_other_than_connect_on_a_dead_link_opens_nothing(self, t: Table) -> None:
        """Only a connect is answered with a fresh session: a ping whose answer our dead
        link refuses ends the session, and no session is opened for it."""
        peer = t.ready(pid(1))
        (dead,) = t.control.links_to(pid(1))
        dead.alive = False
        t.frame(pid(1), Codec().encode(Ping()))  # its pong is refused
        assert t.closed == [(pid(1), CloseKind.UNREACHABLE)]
        assert not peer.session.alive
        assert t.counters.sessions_opened == 1
        fresh = t.table.get(pid(1))
        assert fresh is None or not fresh.session.alive

    def test_the_same_connect_again_is_acknowledged_again(self, t: Table) -> None:
        t.connect_from(pid(1))  # not acknowledged by the peer yet
        t.connect_from(pid(1))
        (link,) = t.control.links_to(pid(1))
        assert [type(m) for m in link.sent] == [Connect, ConnectAck, ConnectAck]
        assert t.closed == []


class TestSuppliers:
    """What the producer bindings reach through the table."""

    def test_no_session_takes_no_supply(self, t: Table) -> None:
        assert not t.table.serves(pid(1))
        t.table.finish_supply(pid(1), "kv", t.now)  # nothing to tell: no error
        assert t.table.next_deadline() is None

    def test_a_live_session_serves(self, t: Table) -> None:
        t.ready(pid(1))
        assert t.table.serves(pid(1))
        assert [peer_id for peer_id, _ in t.table.items()] == [pid(1)]


class TestRegistrationOffTheLock:
    """Invariant 9: a peer registering off the lock has its frames held, in order."""

    def test_held_frames_are_routed_in_order_once_ready_and_others_flow(self) -> None:
        t = Table(slow=True)
        plane = t.plane
        assert isinstance(plane, SlowPlane)
        t.connect_from(pid(1))
        t.ack_from(pid(1))  # held behind its connect
        peer = t.table.get(pid(1))
        assert peer is not None
        assert peer.session.peer_hello is None  # not delivered yet
        (link,) = t.control.links_to(pid(1))
        assert [type(m) for m in link.sent] == [Connect]  # no ack before it registers
        plane.finish(pid(2))  # another peer, ready at once: not held
        t.connect_from(pid(2))
        assert [type(m) for m in t.control.links_to(pid(2))[0].sent] == [Connect, ConnectAck]
        t.poll()
        assert not peer.session.ready  # still registering: still held
        plane.finish(pid(1))
        t.poll()
        assert peer.session.ready  # the connect, then the ack, in order
        assert [type(m) for m in link.sent] == [Connect, ConnectAck]
        assert plane.settled == [pid(1)]
        assert t.table.statistics().stray_frames == 0

    @staticmethod
    def registered_session_5() -> tuple[Table, SlowPlane]:
        """A peer's session 5 registered off the lock and acknowledged by us."""
        t = Table(slow=True)
        plane = t.plane
        assert isinstance(plane, SlowPlane)
        t.connect_from(pid(1), session=5)
        plane.finish(pid(1))
        t.poll()
        return t, plane

    def test_the_peers_next_session_adopted_before_our_ack_registers_off_the_lock(
        self,
    ) -> None:
        """Session invariant 3's adoption registers the peer afresh: its connect is held
        like a first one while the plane prepares it, then adopted (our connect again,
        then the ack of the new number)."""
        t, plane = self.registered_session_5()
        peer = t.table.get(pid(1))
        assert peer is not None
        (link,) = t.control.links_to(pid(1))
        assert [type(m) for m in link.sent] == [Connect, ConnectAck]  # the peer never acks
        plane.forget(pid(1))
        t.connect_from(pid(1), session=6)  # the peer's next session
        assert plane.prepared == [(pid(1), 5), (pid(1), 6)]
        hello = peer.session.peer_hello
        assert hello is not None
        assert session_number(hello) == 5, "held while it registers"
        plane.finish(pid(1))
        t.poll()
        hello = peer.session.peer_hello
        assert hello is not None
        assert session_number(hello) == 6
        assert [type(m) for m in link.sent] == [Connect, ConnectAck, Connect, ConnectAck]
        assert t.table.statistics().stray_frames == 0

    def test_a_connect_after_our_ack_is_never_held(self) -> None:
        """Once the peer acknowledged us, a later connect renews the session (a fresh
        one registers it, held then) and the same one again is acknowledged again: no
        preparation for it either way."""
        t, plane = self.registered_session_5()
        t.ack_from(pid(1))
        peer = t.table.get(pid(1))
        assert peer is not None
        assert peer.session.ready
        plane.forget(pid(1))
        t.connect_from(pid(1), session=5)  # the same again: acknowledged again
        assert plane.prepared == [(pid(1), 5)]
        assert not t.closed
        assert peer.session.ready

    def test_held_frames_are_bounded_in_count_and_bytes(self) -> None:
        t = Table({"max_peer_bytes": 1 << 20}, slow=True)
        t.connect_from(pid(1))
        ping = Codec().encode(Ping())
        for _ in range(MAX_HELD_FRAMES + 10):
            t.frame(pid(1), ping)
        assert t.table.statistics().stray_frames == 11  # the connect took one place
        t2 = Table({"max_peer_bytes": 1 << 20}, slow=True)
        t2.connect_from(pid(1))
        t2.frame(pid(1), b"x" * (1 << 20))  # over the peer's byte budget with the connect
        t2.frame(pid(1), ping)  # still room
        assert t2.table.statistics().stray_frames == 1

    def test_held_frames_are_dropped_after_the_handshake_timeout(self) -> None:
        t = Table(slow=True)
        t.connect_from(pid(1))
        t.ack_from(pid(1))
        assert t.table.next_deadline() is not None
        t.now += t.config.handshake_timeout_s
        t.poll()
        assert t.table.statistics().stray_frames == 2
        peer = t.table.get(pid(1))
        assert peer is None or peer.session.peer_hello is None  # never delivered
