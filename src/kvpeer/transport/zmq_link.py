"""One control link: our DEALER toward one peer, its bounded queue and its connection.

What :class:`kvpeer.transport.zmq_control.ZmqControl` keeps per peer link, and
the socket work on one link: sending what waits, reading its monitor for a lost
connection, reading what the peer sent back, handing a parked connection to the
peer's next link, closing the sockets. The rules are the control's: its queue is
bounded in frames and bytes (rule 2), a lost connection is dead (rule 3), a
closed link may be parked (rule 6). Sockets are touched only under the owner's
lock (rule 1).
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["LINK_HWM", "MONITOR_EVENTS", "LinkOwner", "ZmqLink", "socket_events"]

#: Frames libzmq may hold for one peer (its send high-water mark); the rest wait
#: in our byte-counted queue (rule 2).
LINK_HWM = 16
MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

# Plain ints: flag arithmetic on pyzmq's enums costs more than the socket call.
_EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
NOBLOCK = int(zmq.NOBLOCK)


def socket_events(sock: zmq.Socket[bytes]) -> int:
    """``ZMQ_EVENTS``: what the socket can do now (also runs its pending commands).
    Asking first is cheaper than a receive that raises ``Again``."""
    events = sock.get(_EVENTS)
    assert isinstance(events, int)
    return events


class LinkOwner(Protocol):
    """What a link asks of the control that owns it (the owner's lock held)."""

    def send_now(self, link: ZmqLink, frame: bytes) -> bool: ...

    def mark_dirty(self) -> None: ...

    def lose(self, link: ZmqLink, reason: str) -> None: ...


class ZmqLink:
    """Our DEALER toward one peer; frames queue here until the driver sends them."""

    def __init__(self, owner: LinkOwner, peer_id: str, max_queued: int, max_bytes: int) -> None:
        self._owner = owner
        self._peer_id = peer_id
        self._max_queued = max_queued
        self._max_bytes = max_bytes
        self.queue: deque[bytes] = deque()
        self.queued_bytes = 0
        # Sizes of the last frames handed to libzmq: all it can still hold (rule 2).
        self.recent: deque[int] = deque(maxlen=LINK_HWM + 1)
        self.socket: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.fds: tuple[int, ...] = ()  # ZMQ_FD of socket and monitor, for wait()
        self.connected_once = False
        self.dead_reason: str | None = None
        self.unread: str | None = None  # dead because the peer does not read (rule 2)
        self.closed = False
        self.parked = False  # closed, its connection kept for the peer's next link (rule 6)
        self.parkable = True  # the owner's word when it closed the link
        self.parked_until = 0.0

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and not self.closed

    def transmit(self, frame: bytes) -> bool:
        if not self.alive:
            return False
        if not self.queue and self.socket is not None and self._owner.send_now(self, frame):
            return self.alive
        if len(self.queue) >= self._max_queued:
            self._give_up_unread(
                f"the peer does not read: more than {self._max_queued} frames wait for it "
                "(max_queued_messages)"
            )
            return False
        held = self.queued_bytes + len(frame) + sum(self.recent)
        if held > self._max_bytes:
            self._give_up_unread(
                f"the peer does not read: {held} bytes would wait for it "
                f"(more than max_peer_bytes {self._max_bytes})"
            )
            return False
        self.queue.append(frame)
        self.queued_bytes += len(frame)
        self._owner.mark_dirty()
        return True

    def _give_up_unread(self, reason: str) -> None:
        """What the peer does not read outgrew its bounds (rule 2): the link dies,
        and :attr:`unread` says so (``ControlLink`` rule 6)."""
        self.unread = reason
        self._owner.lose(self, reason)

    def sent(self, frame: bytes) -> None:
        """``frame`` was handed to libzmq (owner's lock held)."""
        self.recent.append(len(frame))

    def close(self, *, park: bool = True) -> None:
        if not self.closed:
            self.closed = True
            self.parkable = park
            self._owner.mark_dirty()

    # -- socket work (the owner's lock held) ------------------------------------------

    def send_queued(self) -> tuple[int, str | None]:
        """Hand queued frames to the open socket until it is full: how many went,
        and why the link is dead if sending failed."""
        sock = self.socket
        assert sock is not None
        count = 0
        while self.queue and self.dead_reason is None:
            try:
                sock.send(self.queue[0], NOBLOCK, copy=len(self.queue[0]) < 65536)
            except zmq.Again:
                break  # high-water mark: try again on the next pump
            except zmq.ZMQError as exc:
                return count, f"send failed: {exc}"
            frame = self.queue.popleft()
            self.queued_bytes -= len(frame)
            self.sent(frame)
            count += 1
        return count, None

    def loss(self) -> str | None:
        """Read the monitor: why the connection is lost (rule 3), or None."""
        monitor = self.monitor
        if monitor is None:
            return None
        while socket_events(monitor) & POLLIN:
            try:
                event = recv_monitor_message(monitor, NOBLOCK)
            except zmq.Again:
                return None
            kind = int(event["event"])
            if kind == zmq.EVENT_CONNECTED:
                self.connected_once = True
            elif kind == zmq.EVENT_CONNECT_RETRIED and not self.connected_once:
                # The first connect failed (refused, unreachable): say so now rather
                # than let ZMQ retry while requests wait (rule 3).
                return "cannot connect (refused or unreachable)"
            elif kind & _HANDSHAKE_FAILED:
                return "security handshake failed (CURVE keys?)"
            elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and self.connected_once:
                return "connection lost"
        return None

    def read(self, limit: int) -> list[bytes]:
        """At most ``limit`` frames the peer sent back on this connection."""
        sock = self.socket
        assert sock is not None
        frames: list[bytes] = []
        for _ in range(limit):
            if not socket_events(sock) & POLLIN:
                break
            try:
                frames.append(sock.recv(NOBLOCK))
            except zmq.ZMQError:
                break
        return frames

    def take_over(self, old: ZmqLink) -> None:
        """Take the connection of ``old`` (parked, forgotten by the owner), frames
        in order after its own (rule 6)."""
        sock = old.socket
        assert sock is not None
        sock.setsockopt(zmq.LINGER, 0)  # its last words went out (or move here)
        self.socket, self.monitor, self.fds = sock, old.monitor, old.fds
        old.socket, old.monitor, old.fds = None, None, ()
        self.connected_once = old.connected_once
        self.recent = old.recent  # libzmq may still hold those frames (rule 2)
        self.queue, self.queued_bytes = old.queue, old.queued_bytes  # in order, first

    def release(self) -> None:
        """Close the sockets (the socket's LINGER: 0, or a moment for last words)."""
        self.fds = ()
        if self.socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.socket.disable_monitor()
            self.socket.close()
            self.socket = None
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
