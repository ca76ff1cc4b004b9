"""ZmqControl with real sockets on loopback, and a real node's clean start and stop.

ZmqControl is pumped by hand here (the node's driver does it in production): every
``receive()`` opens sockets, sends queued frames, reads monitors and the ROUTER.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvpeer.errors import ConfigError, PeerLost
from kvpeer.node.loop import poll_block
from kvpeer.transport.base import InboundFrame
from kvpeer.transport.zmq_control import CurveKeys, ZmqControl, ZmqLink
from kvpeer.types import JobResult, RequestContext, TransferJob
from tests.net.common import DEADLINE_S, keys_of, plane_params
from tests.net.localnode import LocalNode
from tests.net.rawpeer import RawPeer
from tests.net.servingnode import ServingNode

ZmqContext = zmq.Context[zmq.Socket[bytes]]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


HOSTS = [
    "127.0.0.1",
    pytest.param("::1", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6")),
]


class Inbox:
    """Pumps controls and collects what each one received."""

    def __init__(self, *controls: ZmqControl) -> None:
        self.controls = controls
        self.frames: dict[int, list[InboundFrame]] = {id(c): [] for c in controls}

    def of(self, control: ZmqControl) -> list[InboundFrame]:
        return self.frames[id(control)]

    def pump(self) -> None:
        for control in self.controls:
            self.frames[id(control)].extend(control.receive())

    def until(self, predicate: Callable[[], bool], timeout_s: float = DEADLINE_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self.pump()
            if predicate():
                return True
            if time.monotonic() >= deadline:
                return False
            poll_block([fd for c in self.controls for fd in c.descriptors], 0.005)


@pytest.fixture
def controls() -> Iterator[Callable[..., ZmqControl]]:
    """``make(host, **kwargs)``: a ZmqControl on port 0, closed after the test."""
    made: list[ZmqControl] = []

    def make(host: str = "127.0.0.1", **kwargs: object) -> ZmqControl:
        control = ZmqControl(host, 0, **kwargs)  # type: ignore[arg-type]
        made.append(control)
        return control

    try:
        yield make
    finally:
        for control in made:
            control.close()


# -- binding and delivery ---------------------------------------------------------------------


def test_port_zero_binds_a_free_port_and_advertises_it(
    controls: Callable[..., ZmqControl],
) -> None:
    control = controls()

    assert control.port > 0
    assert control.local_id == f"127.0.0.1:{control.port}"
    with pytest.raises(ConfigError, match="cannot bind"):
        ZmqControl("127.0.0.1", control.port)


@pytest.mark.parametrize("host", HOSTS)
def test_frames_arrive_in_order_in_both_directions(
    controls: Callable[..., ZmqControl], host: str
) -> None:
    a, b = controls(host), controls(host)
    if ":" in host:
        assert a.local_id == f"[{host}]:{a.port}"
    frames = [b"%d:" % n + (b"x" * (100_000 if n % 7 == 0 else n)) for n in range(300)]
    a_to_b, b_to_a = a.connect(b.local_id), b.connect(a.local_id)
    inbox = Inbox(a, b)

    for frame in frames:
        assert a_to_b.transmit(frame)
        assert b_to_a.transmit(frame[::-1])
        if len(frame) > 50_000:
            inbox.pump()  # keep the queues short, as the driver does
    assert inbox.until(lambda: len(inbox.of(b)) == len(inbox.of(a)) == len(frames))

    assert [f.frame for f in inbox.of(b)] == frames
    assert [f.frame for f in inbox.of(a)] == [frame[::-1] for frame in frames]
    assert {f.peer_id for f in inbox.of(b)} == {a.local_id}
    assert {f.peer_id for f in inbox.of(a)} == {b.local_id}
    assert a_to_b.alive
    assert b_to_a.alive
    assert a.statistics().frames_sent == b.statistics().frames_received == len(frames)


def test_a_first_frame_leaves_without_the_pump(controls: Callable[..., ZmqControl]) -> None:
    """connect opens the socket at once and transmit sends on it: a first contact's
    connect needs no driver wake-up (a starved driver delayed it by up to ~70 ms).
    Closing the link right away still delivers it (last words linger)."""
    a, b, c = controls(), controls(), controls()
    link = a.connect(b.local_id)
    assert link.transmit(b"first")
    assert not link.queue
    inbox = Inbox(b)  # ``a`` is never pumped
    assert inbox.until(lambda: [f.frame for f in inbox.of(b)] == [b"first"])

    goodbye = c.connect(b.local_id)
    assert goodbye.transmit(b"goodbye")
    goodbye.close()
    c.flush()  # releases the link at once, before its connection may even be up
    assert c.statistics().links == 0
    assert inbox.until(lambda: [f.frame for f in inbox.of(b)][1:] == [b"goodbye"])


def test_malformed_peer_id_is_a_dead_link_not_an_exception(
    controls: Callable[..., ZmqControl],
) -> None:
    control = controls()
    link = control.connect("no-port-here")
    link.transmit(b"hello")

    assert Inbox(control).until(lambda: not link.alive)
    assert link.dead_reason is not None
    assert "cannot connect" in link.dead_reason


def test_frames_of_the_wrong_shape_are_dropped_and_counted(
    controls: Callable[..., ZmqControl], zmq_context: ZmqContext
) -> None:
    control = controls()
    odd = RawPeer(zmq_context, control.local_id, listen=False)
    not_utf8 = RawPeer(zmq_context, control.local_id, listen=False, identity=b"\xff\xfe")
    inbox = Inbox(control)
    try:
        odd.send_raw(b"one", b"two")
        not_utf8.send_raw(b"payload")
        odd.send_raw(b"fine")

        assert inbox.until(lambda: control.statistics().frames_dropped == 2)
        assert inbox.until(lambda: len(inbox.of(control)) == 1)
        assert inbox.of(control) == [InboundFrame(odd.peer_id, b"fine", "127.0.0.1")]
    finally:
        odd.close()
        not_utf8.close()


def test_a_frame_over_the_size_limit_never_arrives(
    controls: Callable[..., ZmqControl], zmq_context: ZmqContext
) -> None:
    control = controls(max_frame_bytes=1024)  # ZMQ refuses frames over 1024 + 4096
    big = RawPeer(zmq_context, control.local_id, listen=False)
    small = RawPeer(zmq_context, control.local_id, listen=False)
    inbox = Inbox(control)
    try:
        big.send_raw(b"B" * 64 * 1024)
        small.send_raw(b"small")
        big.send_raw(b"after the big one")  # its connection was dropped with the big frame

        assert inbox.until(lambda: any(f.frame == b"small" for f in inbox.of(control)))
        inbox.until(lambda: False, timeout_s=0.3)  # a window for a wrong delivery to show

        assert all(len(f.frame) <= 1024 + 4096 for f in inbox.of(control))
    finally:
        big.close()
        small.close()


# -- dead links -------------------------------------------------------------------------------


@pytest.fixture
def stalled_reader(zmq_context: ZmqContext) -> Iterator[tuple[str, zmq.Socket[bytes]]]:
    """A ROUTER that buffers as little as it can; the test decides when it reads."""
    reader = zmq_context.socket(zmq.ROUTER)
    reader.setsockopt(zmq.LINGER, 0)
    reader.setsockopt(zmq.RCVHWM, 1)
    reader.setsockopt(zmq.RCVBUF, 64 * 1024)
    port = reader.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"127.0.0.1:{port}", reader
    finally:
        reader.close(linger=0)


def _flood(control: ZmqControl, link: ZmqLink, limit: int = 20_000) -> int:
    """Transmit 64 KiB frames, pumping as the driver would, until refused; how many went."""
    frame = bytes(64 * 1024)
    deadline = time.monotonic() + DEADLINE_S
    for sent in range(limit):
        if not link.transmit(frame):
            return sent
        control.receive()
        if time.monotonic() > deadline:
            break
    return limit


def _read_once(control: ZmqControl, reader: zmq.Socket[bytes], address: str) -> ZmqLink:
    """A link to ``reader``, connected: one frame went through and was read."""
    link = control.connect(address)
    assert link.transmit(b"first")
    assert Inbox(control).until(lambda: bool(reader.poll(0)))
    assert reader.recv_multipart()[1] == b"first"
    return link


def test_a_peer_that_stops_reading_is_declared_dead(
    controls: Callable[..., ZmqControl], stalled_reader: tuple[str, zmq.Socket[bytes]]
) -> None:
    address, reader = stalled_reader
    control = controls(max_queued_frames=8)
    link = _read_once(control, reader, address)  # it read once, then never again

    sent = _flood(control, link)

    assert sent < 20_000, "the link never pushed back"
    assert not link.alive
    assert link.dead_reason is not None
    assert "more than 8 frames wait for it" in link.dead_reason
    assert link.unread == link.dead_reason  # ControlLink rule 6: its session is over budget
    assert not link.transmit(b"more"), "a dead link takes no frames"


def test_a_link_that_overflowed_is_counted_as_lost(
    controls: Callable[..., ZmqControl], stalled_reader: tuple[str, zmq.Socket[bytes]]
) -> None:
    """``links_lost`` counts every link declared dead: an overflow is one (today the
    overflow path sets ``dead_reason`` itself and skips the counter and the log)."""
    address, reader = stalled_reader
    control = controls(max_queued_frames=8)
    link = _read_once(control, reader, address)
    _flood(control, link)
    assert not link.alive

    assert control.statistics().links_lost == 1


def test_a_reading_peer_is_never_declared_dead(
    controls: Callable[..., ZmqControl],
) -> None:
    # libzmq holds LINK_HWM frames; a sender that outpaces the network waits in our
    # queue (the default size), which a reading peer drains.
    sender, receiver = controls(), controls()
    link = sender.connect(receiver.local_id)
    inbox = Inbox(sender, receiver)
    link.transmit(b"hello")
    assert inbox.until(lambda: len(inbox.of(receiver)) == 1)  # connected
    for n in range(2000):
        assert link.transmit(b"%d" % n), f"refused frame {n}: {link.dead_reason}"
        inbox.pump()
    assert inbox.until(lambda: len(inbox.of(receiver)) == 2001)
    assert link.alive


def test_a_closed_peer_is_a_dead_link(controls: Callable[..., ZmqControl]) -> None:
    a, b = controls(), controls()
    link = a.connect(b.local_id)
    link.transmit(b"hello")
    inbox = Inbox(a, b)
    assert inbox.until(lambda: len(inbox.of(b)) == 1)

    b.close()

    assert Inbox(a).until(lambda: not link.alive)
    assert link.dead_reason == "connection lost"
    assert a.statistics().links_lost == 1


FROZEN_ROUTER = """
import sys, zmq
router = zmq.Context().socket(zmq.ROUTER)
print(router.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    router.recv_multipart()
"""


def test_a_frozen_peer_is_declared_dead_by_heartbeats(
    controls: Callable[..., ZmqControl],
) -> None:
    """SIGSTOP keeps the peer's socket open: only ZMQ heartbeats can notice."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FROZEN_ROUTER], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
        assert readable, "setup: the peer process did not start"
        port = int(proc.stdout.readline())
        control = controls(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
        link = control.connect(f"127.0.0.1:{port}")
        link.transmit(b"hello")
        inbox = Inbox(control)
        assert inbox.until(lambda: link.connected_once and not link.queue)
        inbox.until(lambda: not link.alive, timeout_s=1.5)  # longer than the timeout
        assert link.alive, "heartbeats that are answered keep a link alive"

        proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()

        assert inbox.until(lambda: not link.alive, timeout_s=5.0)
        assert time.monotonic() - frozen_at <= 2.5
        assert link.dead_reason == "connection lost"
    finally:
        proc.kill()
        proc.wait(DEADLINE_S)
        if proc.stdout is not None:
            proc.stdout.close()


# -- CURVE ------------------------------------------------------------------------------------


@pytest.fixture
def curve_keys(tmp_path: Path) -> tuple[CurveKeys, CurveKeys]:
    """(the fleet's keys, a rogue's keys that nobody allowed)."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    public, secret = zmq.auth.create_certificates(tmp_path, "fleet")
    _, rogue_secret = zmq.auth.create_certificates(tmp_path, "rogue")
    os.link(public, allowed / "fleet.key")
    fleet = CurveKeys.load(secret, public, str(allowed))
    rogue = CurveKeys.load(rogue_secret, public, str(allowed))  # knows the server's key
    return fleet, rogue


def test_curve_delivers_between_keyed_peers_and_refuses_a_rogue(
    controls: Callable[..., ZmqControl], curve_keys: tuple[CurveKeys, CurveKeys]
) -> None:
    fleet, rogue = curve_keys
    server, friend, stranger = controls(curve=fleet), controls(curve=fleet), controls(curve=rogue)
    good, bad = friend.connect(server.local_id), stranger.connect(server.local_id)
    good.transmit(b"from a friend")
    bad.transmit(b"from a stranger")
    inbox = Inbox(server, friend, stranger)

    assert inbox.until(lambda: not bad.alive)
    assert inbox.until(lambda: len(inbox.of(server)) == 1)
    assert inbox.of(server) == [InboundFrame(friend.local_id, b"from a friend", "127.0.0.1")]
    assert good.alive
    assert bad.dead_reason is not None


# -- close ------------------------------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_is_idempotent_and_leaves_no_threads_or_sockets(
    curve_keys: tuple[CurveKeys, CurveKeys],
) -> None:
    threads, fds = threading.active_count(), _open_fds()
    fleet, _ = curve_keys
    a, b = ZmqControl("127.0.0.1", 0, curve=fleet), ZmqControl("127.0.0.1", 0)
    link = a.connect(b.local_id)
    back = b.connect(a.local_id)  # plain toward a CURVE server: refused, a dead link
    link.transmit(b"x")
    back.transmit(b"y")
    inbox = Inbox(a, b)
    inbox.until(lambda: not back.alive)
    assert threading.active_count() > threads  # CURVE's authenticator thread

    for control in (a, b, a, b):
        control.close()

    assert threading.active_count() == threads
    assert _open_fds() <= fds
    assert a.receive() == []
    assert not a.pending()
    assert not link.transmit(b"after close")
    with pytest.raises(PeerLost):
        a.connect(b.local_id)


def _ends_soon(wait: Callable[[], None], trigger: Callable[[], object]) -> bool:
    """True if ``wait()`` (waiting up to 5 s) returns soon after ``trigger`` runs on
    another thread 0.1 s in."""
    timer = threading.Timer(0.1, trigger)
    started = time.monotonic()
    timer.start()
    try:
        wait()
    finally:
        timer.cancel()
        timer.join()
    return time.monotonic() - started < 2.0


def test_a_frame_on_an_open_link_leaves_without_a_pump(
    controls: Callable[..., ZmqControl],
) -> None:
    """Once its socket is open, transmit sends at once: the engine thread's fetch
    does not wait for the driver to pump (only the receiver is pumped here)."""
    a, b = controls(), controls()
    link = a.connect(b.local_id)
    link.transmit(b"opens the socket")
    both = Inbox(a, b)
    assert both.until(lambda: len(both.of(b)) == 1)

    link.transmit(b"straight out")

    receiver = Inbox(b)
    assert receiver.until(lambda: len(receiver.of(b)) == 1)
    assert receiver.of(b)[0].frame == b"straight out"


def test_an_arriving_frame_ends_a_wait(controls: Callable[..., ZmqControl]) -> None:
    """A sleep on the descriptors: a frame arriving after a pump drained everything
    and ``pending`` said so still ends it (the edge is not lost)."""
    a, b = controls(), controls()
    link = a.connect(b.local_id)
    link.transmit(b"opens the socket")
    both = Inbox(a, b)
    assert both.until(lambda: len(both.of(b)) == 1)
    assert b.receive() == []  # drained: the next frame must wake the wait by itself
    assert not b.pending()

    assert _ends_soon(lambda: poll_block(b.descriptors, 5.0), lambda: link.transmit(b"late"))
    assert [f.frame for f in b.receive()] == [b"late"]


def test_a_send_that_finds_input_waiting_leaves_it_pending(
    controls: Callable[..., ZmqControl],
) -> None:
    """The edge rule: a send on a DEALER whose peer's answer waits unread may eat
    ``ZMQ_FD``'s edge for it, so ``pending`` reports the answer until it is read.

    The test waits until the answer sits in a's DEALER before that send. (Its first
    version sent until ``pending`` was true, which the link's monitor events - not
    yet read - could make true before the answer had arrived: a flake of the test,
    not of the rule.)"""
    a, b = controls(), controls()
    link = a.connect(b.local_id)
    link.transmit(b"opens the socket")
    inbox = Inbox(b)
    assert inbox.until(lambda: len(inbox.of(b)) == 1)
    b.refuse(a.local_id, b"answer")  # lands on a's DEALER, unread
    dealer = link.socket
    assert dealer is not None
    assert dealer.poll(int(DEADLINE_S * 1000), zmq.POLLIN), "the answer never arrived"
    assert link.transmit(b"more")  # touches the DEALER: may eat the answer's edge
    assert a.pending()
    assert not a.pending()  # reported once; nothing touched since
    assert [f.frame for f in a.receive()] == [b"answer"]
    assert not a.pending()


# -- a real node: clean start and stop --------------------------------------------------------


def _kvpeer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvpeer")]


@pytest.mark.parametrize("plane", plane_params())
def test_nodes_stop_cleanly_after_real_transfers(plane: str) -> None:
    threads = threading.active_count()
    assert _kvpeer_threads() == []
    producer = ServingNode(plane)
    try:
        with LocalNode(plane) as consumer:
            result = consumer.pull(producer.peer_id, keys_of(range(32)), range(32))
            assert (result.hits, result.loaded) == (32, True)
            assert _kvpeer_threads(), "a running node has its driver thread"
    finally:
        producer.close()

    assert _kvpeer_threads() == []
    assert threading.active_count() == threads


def test_a_stopped_node_fails_new_work_instead_of_hanging() -> None:
    consumer = LocalNode("tcp")
    consumer.close()
    node = consumer.node
    node.shutdown()  # idempotent
    context = RequestContext(
        "late",
        {"remote_prefiller": {"kv_request_id": "x", "remote_host": "127.0.0.1", "remote_port": 1}},
    )

    node.on_new_request(context)
    node.submit_load(TransferJob(7, tuple(keys_of([0])), (0,), context))

    assert node.get_finished_jobs() == [JobResult(7, False)]
    assert not node.has_pending_work()
    assert not node.crashed
    assert _kvpeer_threads() == []
