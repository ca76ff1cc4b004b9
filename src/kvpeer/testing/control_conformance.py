"""Conformance checks for control transports (the
:class:`~kvpeer.transport.base.ControlTransport` contract, written out in
:mod:`kvpeer.transport.base`).

A :class:`ControlNet` makes endpoints that can reach each other and names a peer id
nobody answers on. Every check in :data:`CHECKS` takes a factory of nets and builds
its own, so each starts clean; ``tests/transport/test_control_conformance.py`` runs
them on the in-memory network and on ZMQ over loopback. To add a transport, write a
``ControlNet`` for it and run every check with its factory.

Transports may run real threads and sockets: waits are deadline loops that flush and
receive every endpoint, then :meth:`ControlNet.settle` (a fake clock moves a
millisecond; a real one sleeps it) until the condition holds or :data:`TIMEOUT_S`
passes.
"""

from __future__ import annotations

import abc
import socket
import time
from collections.abc import Callable

from kvpeer.errors import PeerLost
from kvpeer.testing.clock import FakeClock
from kvpeer.testing.expect import raises
from kvpeer.testing.network import MemoryNetwork
from kvpeer.transport.base import ControlLink, ControlTransport, InboundFrame

__all__ = [
    "CHECKS",
    "TIMEOUT_S",
    "ControlNet",
    "ControlNetFactory",
    "Inbox",
    "MemoryNet",
    "free_loopback_port",
]

TIMEOUT_S = 5.0


class ControlNet(abc.ABC):
    """Endpoints of one transport that can reach each other."""

    def __init__(self) -> None:
        self.endpoints: list[ControlTransport] = []

    @abc.abstractmethod
    def _make(self) -> ControlTransport: ...

    @abc.abstractmethod
    def absent_peer_id(self) -> str:
        """A well-formed peer id no endpoint answers on."""

    def settle(self) -> None:
        """Let a moment pass (real transports: sleep; fake clocks: advance)."""
        time.sleep(0.001)

    def endpoint(self) -> ControlTransport:
        made = self._make()
        self.endpoints.append(made)
        return made

    def close(self) -> None:
        for made in self.endpoints:
            made.close()

    def __enter__(self) -> ControlNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ControlNetFactory = Callable[[], ControlNet]


class MemoryNet(ControlNet):
    """:class:`~kvpeer.testing.network.MemoryNetwork` endpoints on a fake clock."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.network = MemoryNetwork(self.clock)
        self._names = iter(range(1, 1 << 16))

    def _make(self) -> ControlTransport:
        return self.network.attach(f"10.0.0.{next(self._names)}:5710")

    def absent_peer_id(self) -> str:
        return "10.9.9.9:5710"

    def settle(self) -> None:
        self.clock.advance(0.001)


def free_loopback_port() -> int:
    """A port nothing listens on now (bound, read back, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Inbox:
    """Flushes and receives every endpoint of a net, keeping what each received."""

    def __init__(self, net: ControlNet) -> None:
        self.net = net
        self._frames: dict[int, list[InboundFrame]] = {}

    def of(self, endpoint: ControlTransport) -> list[InboundFrame]:
        return self._frames.setdefault(id(endpoint), [])

    def pump(self) -> None:
        for endpoint in self.net.endpoints:
            endpoint.flush()
        for endpoint in self.net.endpoints:
            self.of(endpoint).extend(endpoint.receive())

    def until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            self.pump()
            if condition():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {TIMEOUT_S} s: {what}")
            self.net.settle()

    def idle(self, rounds: int = 20) -> None:
        """Pump a while with nothing expected (what must not arrive has had its chance)."""
        for _ in range(rounds):
            self.pump()
            self.net.settle()


def _linked(
    net: ControlNet, first: bytes
) -> tuple[ControlTransport, ControlTransport, ControlLink, Inbox]:
    """Endpoints ``a`` and ``b``, a's link to b, and an inbox in which ``first`` (sent
    on that link) has arrived at b."""
    a, b = net.endpoint(), net.endpoint()
    link = a.connect(b.local_id)
    inbox = Inbox(net)
    assert link.transmit(first)
    inbox.until(lambda: len(inbox.of(b)) == 1, "the first frame delivered")
    return a, b, link, inbox


# -- the checks ---------------------------------------------------------------------------


def check_frames_arrive_in_order_tagged_with_the_sender(make: ControlNetFactory) -> None:
    with make() as net:
        a, b = net.endpoint(), net.endpoint()
        a_to_b, b_to_a = a.connect(b.local_id), b.connect(a.local_id)
        frames = [b"%d:" % n + b"x" * (n * 37 % 5000) for n in range(200)]
        inbox = Inbox(net)
        for frame in frames:
            assert a_to_b.transmit(frame)
            assert b_to_a.transmit(frame[::-1])
        inbox.until(
            lambda: len(inbox.of(a)) >= len(frames) and len(inbox.of(b)) >= len(frames),
            "every frame delivered",
        )
        assert [f.frame for f in inbox.of(b)] == frames
        assert [f.frame for f in inbox.of(a)] == [f[::-1] for f in frames]
        assert {f.peer_id for f in inbox.of(b)} == {a.local_id}
        assert {f.peer_id for f in inbox.of(a)} == {b.local_id}
        assert a_to_b.peer_id == b.local_id
        assert a_to_b.alive
        assert b_to_a.alive


def check_refuse_answers_on_the_callers_connection(make: ControlNetFactory) -> None:
    with make() as net:
        a, b, _link, inbox = _linked(net, b"hello")
        b.refuse(a.local_id, b"go away")
        inbox.until(lambda: len(inbox.of(a)) == 1, "refusal delivered")
        assert inbox.of(a) == [InboundFrame(b.local_id, b"go away", inbox.of(a)[0].source)]


def check_refusing_an_unknown_peer_is_silent(make: ControlNetFactory) -> None:
    with make() as net:
        a, b = net.endpoint(), net.endpoint()
        a.refuse(net.absent_peer_id(), b"nobody hears this")
        a.refuse("not an id", b"nor this")
        inbox = Inbox(net)
        inbox.idle()
        assert inbox.of(a) == inbox.of(b) == []


def check_a_link_to_an_absent_peer_never_raises(make: ControlNetFactory) -> None:
    """``connect`` on an open endpoint returns a link whatever the id (unreachable or
    malformed); its ``transmit`` says False or queues the frame, never raises."""
    with make() as net:
        a = net.endpoint()
        for peer_id in (net.absent_peer_id(), "no-port-here"):
            link = a.connect(peer_id)
            assert link.peer_id == peer_id
            assert isinstance(link.transmit(b"anyone?"), bool)
            Inbox(net).idle()
            assert isinstance(link.transmit(b"anyone?"), bool)
            link.close()
            assert not link.alive


def check_a_closed_link_sends_nothing_more(make: ControlNetFactory) -> None:
    with make() as net:
        _a, b, link, inbox = _linked(net, b"before")
        link.close()
        link.close()  # idempotent
        assert not link.alive
        assert link.transmit(b"after") is False
        inbox.idle()
        assert [f.frame for f in inbox.of(b)] == [b"before"]


def check_last_words_still_go_out(make: ControlNetFactory) -> None:
    """A frame transmitted just before ``close`` on a fresh link is delivered (a
    node's goodbye: connect, transmit ``disconnect``, close)."""
    with make() as net:
        a, b = net.endpoint(), net.endpoint()
        link = a.connect(b.local_id)
        assert link.transmit(b"goodbye")
        link.close()
        a.flush()
        inbox = Inbox(net)
        inbox.until(lambda: [f.frame for f in inbox.of(b)] == [b"goodbye"], "goodbye delivered")


def check_a_link_reopened_at_once_is_read_after_the_last_words(
    make: ControlNetFactory,
) -> None:
    """A session that ends and is opened again at once (a renewal): the peer reads
    the new link, after what the closed one sent last."""
    with make() as net:
        a, b, link, inbox = _linked(net, b"0: hello")
        expected = [b"0: hello"]
        for n in range(1, 6):
            assert link.transmit(b"%d: goodbye" % (n - 1))
            link.close()
            link = a.connect(b.local_id)
            assert link.transmit(b"%d: hello" % n)
            expected += [b"%d: goodbye" % (n - 1), b"%d: hello" % n]
        inbox.until(
            lambda: len(inbox.of(b)) >= len(expected), "every reopened link's frames read"
        )
        assert [f.frame for f in inbox.of(b)] == expected
        assert link.alive


def check_a_closed_peer_is_a_dead_link(make: ControlNetFactory) -> None:
    with make() as net:
        _a, b, link, inbox = _linked(net, b"hello")
        b.close()
        inbox.until(lambda: not link.alive, "the link to a closed peer dies")
        assert link.transmit(b"anyone?") is False
        assert link.unread is None  # gone, not a peer that does not read (rule 6)


def check_a_closed_endpoint_is_inert(make: ControlNetFactory) -> None:
    """After ``close``: links are dead, ``transmit`` says False, ``receive`` is empty,
    ``flush``, ``refuse`` and ``close`` do nothing, ``connect`` raises ``PeerLost``."""
    with make() as net:
        a, b = net.endpoint(), net.endpoint()
        link = a.connect(b.local_id)
        back = b.connect(a.local_id)
        inbox = Inbox(net)
        assert back.transmit(b"unread")
        inbox.until(lambda: back.alive and len(inbox.of(a)) == 1, "frame delivered")
        assert back.transmit(b"never read")
        b.flush()
        a.close()
        assert not link.alive
        assert link.transmit(b"late") is False
        assert a.receive() == []
        a.flush()
        a.refuse(b.local_id, b"late")
        a.close()
        with raises(PeerLost):
            a.connect(b.local_id)
        inbox.idle()
        assert inbox.of(b) == []


CHECKS: list[Callable[[ControlNetFactory], None]] = [
    check_frames_arrive_in_order_tagged_with_the_sender,
    check_refuse_answers_on_the_callers_connection,
    check_refusing_an_unknown_peer_is_silent,
    check_a_link_to_an_absent_peer_never_raises,
    check_a_closed_link_sends_nothing_more,
    check_last_words_still_go_out,
    check_a_link_reopened_at_once_is_read_after_the_last_words,
    check_a_closed_peer_is_a_dead_link,
    check_a_closed_endpoint_is_inert,
]
