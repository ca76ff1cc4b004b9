"""A link reopened between two live ZmqControls is read by the peer (issue 11).

The peer's ROUTER keeps ``ROUTER_HANDOVER`` off, so it never reads a second
connection under an identity whose first connection it still holds. A session
that ends and is opened again at once (a renewal) must therefore not need a second
connection while the first is open at the peer. These tests close a link, dial
the same peer again and send, many times over, and count how often the peer read
the fresh link's frame; and they check that a third process claiming a live peer's
identity is never read, in the gap between two sessions too.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvpeer.node.loop import poll_block
from kvpeer.transport.base import InboundFrame
from kvpeer.transport.zmq_control import CurveKeys, ZmqControl, ZmqLink

TRIES = 20
READ_WITHIN_S = 1.0

ZmqContext = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def pair() -> Iterator[tuple[ZmqControl, ZmqControl]]:
    a, b = ZmqControl("127.0.0.1", 0), ZmqControl("127.0.0.1", 0)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _pump_until(
    controls: tuple[ZmqControl, ...],
    got: dict[int, list[InboundFrame]],
    done: Callable[[], bool],
    timeout_s: float,
) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        for control in controls:
            got.setdefault(id(control), []).extend(control.receive())
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        poll_block([fd for c in controls for fd in c.descriptors], 0.005)


def _arrived(got: dict[int, list[InboundFrame]], key: int, frame: bytes) -> bool:
    return any(f.frame == frame for f in got[key])


def _reopened_reads(a: ZmqControl, b: ZmqControl, *, pump_between: bool) -> int:
    """How many of TRIES fresh links from ``a`` the peer ``b`` read within
    READ_WITHIN_S, each dialled right after the previous one closed."""
    got: dict[int, list[InboundFrame]] = {}
    link = a.connect(b.local_id)
    assert link.transmit(b"first")
    assert _pump_until((a, b), got, lambda: len(got.get(id(b), [])) == 1, 10.0)
    reads = 0
    for n in range(TRIES):
        link.close()
        if pump_between:
            a.receive()  # the closed link is handled by a pump before the next dial
        link = a.connect(b.local_id)
        frame = b"try %d" % n
        assert link.transmit(frame)
        if _pump_until((a, b), got, functools.partial(_arrived, got, id(b), frame), READ_WITHIN_S):
            reads += 1
        else:
            # The unread link stays unread for good: start the next try afresh.
            link.close()
            a.receive()
            link = a.connect(b.local_id)
            link.transmit(b"resync %d" % n)
            _pump_until((a, b), got, lambda: False, 0.05)
    return reads


def _one_frame_across(
    pair: tuple[ZmqControl, ZmqControl],
) -> tuple[ZmqControl, ZmqControl, dict[int, list[InboundFrame]], ZmqLink]:
    """``a``'s new link to ``b`` carried one frame, read by ``b``."""
    a, b = pair
    got: dict[int, list[InboundFrame]] = {}
    link = a.connect(b.local_id)
    link.transmit(b"one")
    assert _pump_until((a, b), got, lambda: len(got.get(id(b), [])) == 1, 10.0)
    return a, b, got, link


def _parked_after_one_frame(
    pair: tuple[ZmqControl, ZmqControl],
) -> tuple[ZmqControl, ZmqControl, dict[int, list[InboundFrame]]]:
    """``a``'s link to ``b`` carried one frame, then closed: parked."""
    a, b, got, link = _one_frame_across(pair)
    link.close()
    a.receive()
    assert a.statistics().links_parked == 1
    return a, b, got


@pytest.mark.parametrize("pump_between", [False, True], ids=["at-once", "after-a-pump"])
def test_a_reopened_link_is_read_every_time(
    pair: tuple[ZmqControl, ZmqControl], pump_between: bool
) -> None:
    a, b = pair

    reads = _reopened_reads(a, b, pump_between=pump_between)

    assert reads == TRIES, f"the peer read {reads} of {TRIES} reopened links"


def test_the_last_words_of_a_closed_link_come_before_the_next_links_frames(
    pair: tuple[ZmqControl, ZmqControl],
) -> None:
    a, b = pair
    got: dict[int, list[InboundFrame]] = {}
    expected: list[bytes] = []
    link = a.connect(b.local_id)
    for n in range(10):
        frames = [b"%d: hello" % n, b"%d: goodbye" % n]
        for frame in frames:
            assert link.transmit(frame)
        expected += frames
        link.close()
        link = a.connect(b.local_id)

    assert _pump_until((a, b), got, lambda: len(got.get(id(b), [])) == len(expected), 10.0)
    assert [f.frame for f in got[id(b)]] == expected


def test_a_reopened_link_answers_on_the_same_connection(
    pair: tuple[ZmqControl, ZmqControl],
) -> None:
    """A refusal the peer sends back (ROUTER -> our DEALER) reaches the new link."""
    a, b, got, link = _one_frame_across(pair)
    link.close()
    link = a.connect(b.local_id)
    link.transmit(b"two")
    assert _pump_until((a, b), got, lambda: len(got[id(b)]) == 2, READ_WITHIN_S)

    b.refuse(a.local_id, b"no")

    assert _pump_until((a, b), got, lambda: len(got.get(id(a), [])) == 1, 10.0)
    assert got[id(a)][0].frame == b"no"
    assert got[id(a)][0].peer_id == b.local_id
    assert link.alive


def test_a_closed_link_to_a_peer_that_went_away_is_not_reused(
    pair: tuple[ZmqControl, ZmqControl],
) -> None:
    a, b, got = _parked_after_one_frame(pair)
    port = b.port
    b.close()
    assert _pump_until((a,), got, lambda: a.statistics().links_parked == 0, 10.0)

    fresh = ZmqControl("127.0.0.1", port)  # a restarted peer on the same port
    try:
        link = a.connect(fresh.local_id)
        link.transmit(b"to the new incarnation")
        assert _pump_until((a, fresh), got, lambda: len(got.get(id(fresh), [])) == 1, 10.0)
        assert link.alive
    finally:
        fresh.close()


def test_a_link_closed_without_parking_releases_its_connection(
    pair: tuple[ZmqControl, ZmqControl],
) -> None:
    """The owner closes a link toward a peer that fell silent with ``park=False``:
    nothing is kept (a partitioned peer's connection lingered 10 s otherwise), and the
    next link dials afresh."""
    a, _, _, link = _one_frame_across(pair)
    link.close(park=False)
    a.receive()
    assert a.statistics().links_parked == 0
    assert a.statistics().links == 0
    assert a.next_deadline() is None


# -- the attacker ----------------------------------------------------------------------------


def _impostor(context: ZmqContext, identity: str, endpoint: str) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(endpoint)
    return sock


@pytest.mark.parametrize("when", ["live", "between-sessions"])
def test_a_process_claiming_a_live_peers_identity_is_never_read(
    pair: tuple[ZmqControl, ZmqControl], when: str
) -> None:
    """The impostor connects under ``a``'s identity while ``a``'s link is open, or
    right after ``a`` closed it (a session ended); ``a`` then keeps talking on a
    fresh link. ``b`` reads every frame of ``a`` and none of the impostor's."""
    a, b = pair
    got: dict[int, list[InboundFrame]] = {}
    context: ZmqContext = zmq.Context()
    try:
        link = a.connect(b.local_id)
        link.transmit(b"a: hello")
        assert _pump_until((a, b), got, lambda: len(got.get(id(b), [])) == 1, 10.0)
        if when == "between-sessions":
            link.close()
            a.receive()
        impostor = _impostor(context, a.local_id, f"tcp://{b.local_id}")
        for n in range(5):
            impostor.send(b"impostor %d" % n)
        # Give the impostor's connection every chance to be read before a goes on.
        _pump_until((a, b), got, lambda: False, 0.2)
        if when == "live":
            link.close()
        link = a.connect(b.local_id)
        for n in range(5):
            link.transmit(b"a: %d" % n)
        assert _pump_until((a, b), got, lambda: len(got[id(b)]) >= 6, 10.0)
        _pump_until((a, b), got, lambda: False, 0.2)  # anything more would show now
        impostor.close()
    finally:
        context.destroy(linger=0)

    assert [f.frame for f in got[id(b)]] == [b"a: hello"] + [b"a: %d" % n for n in range(5)]


def test_what_the_peer_sends_on_a_parked_link_is_dropped_not_handed_to_the_next(
    pair: tuple[ZmqControl, ZmqControl],
) -> None:
    a, b, got = _parked_after_one_frame(pair)

    b.refuse(a.local_id, b"an answer to the session that ended")

    assert _pump_until((a, b), got, lambda: a.statistics().frames_dropped == 1, 10.0)
    link = a.connect(b.local_id)
    link.transmit(b"two")
    assert _pump_until((a, b), got, lambda: len(got[id(b)]) == 2, READ_WITHIN_S)
    assert got.get(id(a), []) == []
    assert a.statistics().links_parked == 0


@pytest.mark.parametrize("parked", [False, True], ids=["open", "parked"])
def test_an_oversized_answer_closes_the_link_instead_of_being_read(parked: bool) -> None:
    """A hostile peer's frames back on our DEALER are bounded like those to our
    ROUTER: over the size limit, libzmq drops the connection."""
    context: ZmqContext = zmq.Context()
    a = ZmqControl("127.0.0.1", 0, max_frame_bytes=1000)
    try:
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        link = a.connect(f"127.0.0.1:{port}")
        link.transmit(b"hello")
        identity, _ = router.recv_multipart()
        if parked:
            link.close()
            a.receive()
            assert a.statistics().links_parked == 1

        router.send_multipart([identity, b"x" * 10_000])

        got: dict[int, list[InboundFrame]] = {}
        if parked:
            assert _pump_until((a,), got, lambda: a.statistics().links_parked == 0, 10.0)
        else:
            assert _pump_until((a,), got, lambda: not link.alive, 10.0)
            assert link.dead_reason == "connection lost"
        assert got.get(id(a), []) == []
    finally:
        a.close()
        context.destroy(linger=0)


def test_a_parked_link_closes_when_its_time_is_up() -> None:
    now = [100.0]
    a = ZmqControl("127.0.0.1", 0, park_s=5.0, clock=lambda: now[0])
    b = ZmqControl("127.0.0.1", 0)
    try:
        got: dict[int, list[InboundFrame]] = {}
        link = a.connect(b.local_id)
        link.transmit(b"one")
        assert _pump_until((a, b), got, lambda: len(got.get(id(b), [])) == 1, 10.0)
        assert a.next_deadline() is None
        link.close()
        a.receive()
        assert a.statistics().links_parked == 1
        assert a.next_deadline() == 105.0

        now[0] = 104.9
        a.receive()
        assert a.statistics().links_parked == 1
        now[0] = 105.0
        a.receive()

        assert a.statistics().links_parked == 0
        assert a.next_deadline() is None
        assert a.descriptors == (a.descriptors[0],)  # the ROUTER's alone
    finally:
        a.close()
        b.close()


# -- links that are not parked (rule 7) -------------------------------------------------------

QUICK_REOPENS = 10


@pytest.fixture
def curve_pair(tmp_path: Path) -> Iterator[tuple[ZmqControl, ZmqControl]]:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    public, secret = zmq.auth.create_certificates(tmp_path, "fleet")
    os.link(public, allowed / "fleet.key")
    keys = CurveKeys.load(secret, public, str(allowed))
    a, b = ZmqControl("127.0.0.1", 0, curve=keys), ZmqControl("127.0.0.1", 0, curve=keys)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_with_curve_every_fresh_link_is_read_at_once(
    curve_pair: tuple[ZmqControl, ZmqControl],
) -> None:
    """Issue 30, item 1: ten quick reopens in a row that cannot reuse the last link's
    connection (closed without parking: the peer fell silent, a goodbye's link), each
    a fresh connection under the same identity while the peer may still hold the
    last. Between authenticated peers the newest connection takes the identity over,
    so the peer reads every one of them within READ_WITHIN_S (plain peers: 6 of 10)."""
    a, b = curve_pair
    got: dict[int, list[InboundFrame]] = {}
    link = a.connect(b.local_id)
    assert link.transmit(b"first")
    assert _pump_until((a, b), got, lambda: len(got.get(id(b), [])) == 1, 10.0)
    read = []
    for n in range(QUICK_REOPENS):
        link.close(park=False)
        a.receive()
        assert a.statistics().links_parked == 0
        link = a.connect(b.local_id)
        frame = b"reopen %d" % n
        assert link.transmit(frame)
        arrived = functools.partial(_arrived, got, id(b), frame)
        read.append(_pump_until((a, b), got, arrived, READ_WITHIN_S))

    assert read == [True] * QUICK_REOPENS
    assert [f.frame for f in got[id(b)]] == [b"first"] + [
        b"reopen %d" % n for n in range(QUICK_REOPENS)
    ]
