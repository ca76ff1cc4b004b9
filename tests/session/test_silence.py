"""A request's wait on a peer that went quiet after the handshake (``kvpeer.session.peer``
invariant 4): pinged, then given up after ``peer_wait_s`` of silence - but never a peer
that answers, however long its engine takes to answer the request itself.

"Frozen" here means nothing a sends is delivered to b (a process stopped by SIGSTOP
reads nothing and says nothing); time moves by hand.
"""

from __future__ import annotations

from functools import partial

import msgspec
import pytest

from kvpeer.protocol import Disconnect, Fetch, Ping, Pong
from kvpeer.session import CloseKind, SessionSettings
from kvpeer.testing import SessionPair, make_hello
from kvpeer.testing.steps import closed, fetch, probe, sent
from kvpeer.types import Key

WAIT = 1.5  # peer_wait_s of these tests (quarters are exact in binary)
ID = "req-1"


def key(n: int) -> Key:
    return b"silence-key-%04d" % n


def pair(**kwargs: object) -> SessionPair:
    return SessionPair(settings=SessionSettings(peer_wait_s=WAIT), **kwargs)  # type: ignore[arg-type]


def poll_a(p: SessionPair) -> None:
    p.a.record(p.a.session.poll(p.clock.now))


class TestFrozenPeer:
    def test_a_waiting_load_is_failed_peer_wait_s_after_it_began(self) -> None:
        p = pair()
        began = p.clock.now
        job = fetch(p, [key(0)], [3], ID)
        assert p.a.session.next_deadline() == began + WAIT / 4  # the ping
        p.clock.advance(WAIT / 4)
        poll_a(p)
        assert sent(p.a, Ping) == [Ping()]
        assert p.a.session.next_deadline() == began + WAIT  # one ping per quiet spell
        p.clock.advance(WAIT * 3 / 4 - 0.01)
        poll_a(p)
        assert p.a.closed is None
        assert job not in p.a.loads
        p.clock.advance(0.01)
        poll_a(p)
        ended = closed(p.a)
        assert ended.kind is CloseKind.UNREACHABLE
        assert "nothing heard" in ended.reason
        assert not p.a.loads[job].success
        assert len(sent(p.a, Disconnect)) == 1  # read by the peer when it resumes
        assert p.a.session.statistics().pings_sent == 1

    def test_probes_wait_no_longer_than_loads(self) -> None:
        p = pair()
        began = p.clock.now
        assert probe(p, ID, key(0)) == [None]
        p.a.session.flush_lookups()
        p.clock.advance(WAIT / 4)
        poll_a(p)
        p.clock.advance(WAIT * 3 / 4)
        poll_a(p)
        assert closed(p.a).kind is CloseKind.UNREACHABLE
        assert closed(p.a).failed_request_ids == (ID,)
        assert p.clock.now == began + WAIT

    def test_the_quiet_clock_starts_when_the_wait_begins(self) -> None:
        """Last heard long ago (an idle link) is no evidence: the wait gets its budget."""
        p = pair()
        p.clock.advance(100.0)
        poll_a(p)
        began = p.clock.now
        fetch(p, [key(0)], [3], ID)
        assert p.a.session.next_deadline() == began + WAIT / 4

    def test_a_later_request_shares_the_quiet_spell_of_an_earlier_one(self) -> None:
        """Silence is a fact about the peer: a request that starts waiting while another
        already waits on a quiet peer does not restart the clock."""
        p = pair()
        began = p.clock.now
        first = fetch(p, [key(0)], [3], ID)
        p.clock.advance(WAIT / 2)
        poll_a(p)
        second = fetch(p, [key(1)], [4], "req-2")
        p.clock.advance(WAIT / 2)
        poll_a(p)
        assert closed(p.a).kind is CloseKind.UNREACHABLE
        assert p.clock.now == began + WAIT
        assert not p.a.loads[first].success
        assert not p.a.loads[second].success


class TestLivePeer:
    def test_a_busy_peer_that_answers_pings_is_never_given_up(self) -> None:
        """b's engine never serves the fetch (no supply), its node answers every ping:
        the load waits for its own timeout, not peer_wait_s."""
        p = pair()
        job = fetch(p, [key(0)], [3], ID)
        p.pump()
        p.advance(15 * WAIT)  # under load_timeout_s
        p.pump()
        assert p.a.closed is None
        assert p.b.closed is None
        assert job not in p.a.loads
        pings = p.a.session.statistics().pings_sent
        assert pings >= 15  # about one per quarter budget of quiet
        assert len(sent(p.b, Pong)) == pings

    def test_a_frame_restarts_the_quiet_clock(self) -> None:
        p = pair()
        began = p.clock.now
        fetch(p, [key(0)], [3], ID)
        p.pump()
        p.clock.advance(WAIT / 8)
        p.a.session.receive(msgspec.msgpack.encode({"type": "pong"}), p.clock.now)
        assert p.a.session.next_deadline() == began + WAIT / 8 + WAIT / 4

    def test_a_quiet_peer_nobody_waits_on_is_not_pinged(self) -> None:
        p = pair()
        assert p.a.session.next_deadline() is None
        p.clock.advance(1000.0)
        p.pump()
        assert sent(p.a, Ping) == []
        assert p.a.closed is None

    def test_a_ping_is_answered_with_work_waiting_for_a_serve_window(self) -> None:
        """The node answers at once; the engine's serve window is not needed."""
        p = pair()
        assert probe(p, ID, key(0)) == [None]
        p.a.session.flush_lookups()
        p.pump()
        assert p.b.session.needs_serve()  # the lookup waits for b's engine
        p.b.session.receive(msgspec.msgpack.encode({"type": "ping"}), p.clock.now)
        assert sent(p.b, Pong) == [Pong()]


@pytest.mark.parametrize("version", [None, (1, 0)], ids=["vllm", "kvpeer-1.0"])
def test_a_peer_that_cannot_answer_pings_is_left_to_the_heartbeat(
    version: tuple[int, int] | None,
) -> None:
    """Pinging a peer that ignores pings would give up every busy one: once it has
    spoken, only the transport's heartbeat (and the session timeouts) judge it."""
    # b is a peer of ``version`` (None: a vLLM peer, no kvpeer extension)
    p = pair(hello_b=partial(make_hello, "b", kvpeer=version or False))
    job = fetch(p, [key(0)], [3], ID)
    p.pump()
    p.clock.advance(10 * WAIT)
    poll_a(p)
    assert p.a.closed is None
    assert job not in p.a.loads
    assert sent(p.a, Ping) == []
    assert [f.round_seq for f in sent(p.a, Fetch)] == [0]
