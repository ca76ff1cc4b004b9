"""The session's one exception boundary (invariant 5 of ``kvpeer.session.peer``).

Whatever a data plane or a role raises while handling the peer's input ends
that session with a named kind; nothing leaves ``receive``/``poll``/``serve``.
The node-level regression (the tcp ``connect_ack`` that killed a driver) lives in
tests/security.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpeer.errors import DataPlaneError, LocalFault, ProtocolError
from kvpeer.protocol import (
    AckExtension,
    Codec,
    ConnectAck,
    Disconnect,
    Fetch,
    TransportChoice,
)
from kvpeer.session import CloseKind, PeerSession, PollResult, SessionSettings
from kvpeer.testing import Fabric, FakeDataPlane, Region, make_hello
from kvpeer.types import StoreJob

CODEC = Codec()


class Exploding(FakeDataPlane):
    """A fake plane that raises ``error`` from ``where``."""

    def __init__(self, fabric: Fabric, node_id: str, region: Region) -> None:
        super().__init__(fabric, node_id, region)
        self.where = ""
        self.error: Exception = RuntimeError("boom")

    def peer_acknowledged(self, peer_id: str, choice: TransportChoice | None) -> None:
        if self.where == "peer_acknowledged":
            raise self.error
        super().peer_acknowledged(peer_id, choice)

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        if self.where == "write_blocks":
            raise self.error
        return super().write_blocks(peer_id, local_slots, remote_slots)

    def unregister_peer(self, peer_id: str) -> None:
        super().unregister_peer(peer_id)
        if self.where == "unregister_peer":
            raise self.error


class Solo:
    """Our session toward a hand-driven peer ``p`` (its region exists in the fabric)."""

    def __init__(self) -> None:
        fabric = Fabric()
        self.region = Region(16, 64)
        self.plane = Exploding(fabric, "us", self.region)
        FakeDataPlane(fabric, "p", Region(16, 64))  # the peer's region, for registration
        self.sent: list[bytes] = []
        self.session = PeerSession(
            "p",
            make_hello("us", self.region),
            self.plane,
            self._transmit,
            SessionSettings(),
        )
        self.session.start(0.0)

    def _transmit(self, frame: bytes) -> bool:
        self.sent.append(frame)
        return True

    def feed(self, *messages: object) -> PollResult:
        for message in messages:
            self.session.receive(CODEC.encode(message), 1.0)  # type: ignore[arg-type]
        return self.session.poll(1.0)

    def last_disconnect(self) -> Disconnect:
        message = CODEC.decode(self.sent[-1])
        assert isinstance(message, Disconnect)
        return message


def peer_hello() -> object:
    return make_hello("p", Region(16, 64))


def test_connect_ack_with_unusable_transport_params_ends_only_the_session() -> None:
    """The reproduction: tcp chosen with empty params raised out of ``receive``."""
    solo = Solo()
    solo.plane.where = "peer_acknowledged"
    solo.plane.error = DataPlaneError("tcp: 'p' sent no valid token: {}")
    ack = ConnectAck(
        peer_id="p",
        kvpeer=AckExtension(version=(1, 0), transport=TransportChoice(name="tcp", params={})),
    )
    result = solo.feed(peer_hello(), ack)
    assert result.closed is not None
    assert result.closed.kind is CloseKind.PEER_FAULT
    assert "no valid token" in result.closed.reason
    assert "no valid token" in solo.last_disconnect().reason
    assert not solo.session.alive


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (DataPlaneError("the peer's parameters are unusable"), CloseKind.PEER_FAULT),
        (LocalFault("our backend is closed"), CloseKind.LOCAL_FAULT),
        (KeyError("a bug of ours"), CloseKind.INTERNAL_ERROR),
        (ProtocolError("not allowed"), CloseKind.PROTOCOL_ERROR),
    ],
)
def test_what_was_raised_names_how_the_session_ended(error: Exception, kind: CloseKind) -> None:
    solo = Solo()
    solo.plane.where = "peer_acknowledged"
    solo.plane.error = error
    result = solo.feed(peer_hello(), ConnectAck(peer_id="p"))
    closed = result.closed
    assert closed is not None
    assert closed.kind is kind
    ours = kind in (CloseKind.INTERNAL_ERROR, CloseKind.LOCAL_FAULT)
    assert closed.error is (error if ours else None)
    assert solo.last_disconnect().reason == closed.reason[:512]


def test_a_bug_met_while_serving_a_fetch_ends_the_session_and_reports_its_jobs() -> None:
    solo = Solo()
    solo.feed(peer_hello(), ConnectAck(peer_id="p"))
    assert solo.session.ready
    solo.plane.where = "write_blocks"
    solo.plane.error = KeyError("a bug of ours")
    key = b"k" * 8
    assert solo.session.add_supply("r1", StoreJob(7, (key,), (3,)), 1.0)
    result = solo.feed(Fetch(kv_request_id="r1", keys=(key,), block_indexes=(5,), round_seq=0))
    assert result.closed is not None
    assert result.closed.kind is CloseKind.INTERNAL_ERROR
    assert [(s.job_id, s.success) for s in result.closed.stores] == [(7, False)]
    assert solo.session.poll(2.0).closed is None  # reported once


def test_a_failed_write_start_fails_the_round_and_keeps_the_session() -> None:
    solo = Solo()
    solo.feed(peer_hello(), ConnectAck(peer_id="p"))
    solo.plane.where = "write_blocks"
    solo.plane.error = DataPlaneError("remote slot 5 outside 0..3")
    key = b"k" * 8
    solo.session.add_supply("r1", StoreJob(7, (key,), (3,)), 1.0)
    result = solo.feed(Fetch(kv_request_id="r1", keys=(key,), block_indexes=(5,), round_seq=0))
    assert result.closed is None
    assert [(s.job_id, s.success) for s in result.stores] == [(7, False)]
    assert solo.session.alive


def test_a_failing_unregister_still_ends_the_session_once() -> None:
    solo = Solo()
    solo.feed(peer_hello(), ConnectAck(peer_id="p"))
    solo.plane.where = "unregister_peer"
    solo.plane.error = LocalFault("mapping kept: a copy did not stop")
    result = solo.feed(Disconnect(reason="bye"))
    assert result.closed is not None
    assert result.closed.kind is CloseKind.DISCONNECTED
    assert "mapping kept" in result.closed.reason
    assert solo.session.poll(2.0).closed is None


def test_owner_misuse_still_raises() -> None:
    fabric = Fabric()
    region = Region(16, 64)
    session = PeerSession(
        "p", make_hello("us", region), FakeDataPlane(fabric, "us", region), lambda _: True
    )
    with pytest.raises(ProtocolError):
        session.receive(CODEC.encode(Disconnect()), 0.0)
