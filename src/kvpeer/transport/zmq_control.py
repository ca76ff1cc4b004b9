"""The ZMQ control channel (docs/protocol.md section 1): the ROUTER, the pump, the links.

One ROUTER bound on ``tcp://host:port`` receives every peer's frames as
``[identity, payload]``; one DEALER per peer, with our peer id as identity,
carries ours (:mod:`kvpeer.transport.zmq_link`: one link, its queue and its
socket work). Socket rules:

1. Sockets are touched only by calls the owner serialises (the node's lock):
   :meth:`ZmqControl.receive` and :meth:`ZmqControl.flush` (the pump),
   :meth:`ZmqControl.connect`, :meth:`ZmqLink.transmit`, :meth:`ZmqControl.refuse`
   and :meth:`ZmqControl.close`. ``connect`` opens the link's socket at once and
   ``transmit`` sends at once, without blocking, on a link whose socket is open and
   has nothing queued, so a frame from the engine thread - a first contact's
   ``connect`` too - leaves without a hop through the driver; anything else is
   queued for the pump. Only the pump closes sockets.
   The control does socket work only; it never sleeps or wakes anyone. It says
   what an owner may sleep on (:attr:`ZmqControl.descriptors`: ``ZMQ_FD`` of each
   live socket) and, after socket work, whether work waits that those will not
   announce (:meth:`ZmqControl.pending`). ``ZMQ_FD`` is edge-triggered: any call
   on a socket may eat the edge of work that arrived before it. So every socket
   call marks its socket *touched*, and ``pending`` - the one place that re-checks
   ``ZMQ_EVENTS`` - asks each touched socket whether it still has input (or queued
   frames it can now send), and whether frames wait for the pump. The node's loop
   (:mod:`kvpeer.node.loop`) calls it whenever it leaves the lock.
2. Every queue is bounded, in frames and in bytes. A link's DEALER holds at most
   :data:`LINK_HWM` frames inside libzmq; past that, frames wait in our own
   queue. What a peer that stopped reading makes us hold - our queue plus the
   last ``LINK_HWM + 1`` frames handed to libzmq (all it can still hold) - is
   checked against ``max_link_bytes`` whenever a frame has to wait; over it,
   or over ``max_queued_frames``, the peer is declared dead, and the link's
   ``unread`` says why (its session ends ``over_budget``, not ``unreachable``).
3. A DEALER that loses its connection after it was established (heartbeat
   timeout, peer closed), or whose first connect fails (refused, unreachable),
   is dead; ZMQ's reconnect is not trusted to bring the same peer incarnation
   back - the session layer starts over instead.
4. ``MAXMSGSIZE`` bounds inbound frames; anything but two frames with a UTF-8
   identity is dropped and counted.
5. With CURVE, the ROUTER only accepts clients whose public key is in the
   allowed directory, and every DEALER authenticates the server's key.
6. A peer's ROUTER never reads a second connection under our identity while it
   still holds the first (``ROUTER_HANDOVER`` off, here and in vLLM), and it lets
   go of the first only some commands after that connection closed. So a link
   that closes with its connection up (or coming up) keeps it: the link is
   *parked* (:mod:`kvpeer.transport.zmq_parking`; its last words still go out on
   it) and the next link to that peer takes the connection over, frames in order
   after the old link's. Nothing is
   read from a parked connection (what the peer sends on it is dropped and
   counted); it is closed when it is lost, ``park_s`` after it was parked (the
   owner's timer: :meth:`ZmqControl.next_deadline`), when a newer link to the
   peer is parked, when more than ``max_parked_links`` are (oldest first), and
   with the control. Between sessions our identity stays held at the peer by our
   own connection, so nobody else can claim it there either.
7. Links that are not parked (the peer fell silent or restarted, a goodbye's link,
   a link that died) leave the next link a fresh connection, which a peer's ROUTER
   with ``ROUTER_HANDOVER`` off may not read while it still holds the old one (6 of
   10 immediate reopens were read within 1 s). With CURVE our ROUTER has handover
   on: only holders of an allowed client key connect at all, and a fresh
   connection under an identity replaces the old one at once (10 of 10). Without
   CURVE it stays off: anyone who reaches the port could then cut a live peer's
   connection at will.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvpeer.errors import ConfigError, PeerLost
from kvpeer.protocol import limits
from kvpeer.transport.base import InboundFrame
from kvpeer.transport.zmq_link import (
    LINK_HWM,
    MONITOR_EVENTS,
    NOBLOCK,
    POLLIN,
    POLLOUT,
    ZmqLink,
    socket_events,
)
from kvpeer.transport.zmq_parking import MAX_PARKED_LINKS, PARK_S, Parking

__all__ = ["CurveKeys", "ZmqControl", "ZmqLink", "ZmqStatistics"]

log = logging.getLogger("kvpeer.zmq")

_LAST_WORDS_LINGER_MS = 200
#: How long a control connection may take to finish ZMQ's own handshake (libzmq's
#: default is 30 s: half-open connections would pile up for that long).
ZMQ_HANDSHAKE_MS = 5000


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """CURVE material: our key pair, the servers' public key, allowed client keys."""

    public: bytes
    secret: bytes
    server_public: bytes
    clients_dir: str

    @classmethod
    def load(
        cls, secret_key_file: str, server_public_key_file: str, client_public_keys_dir: str
    ) -> CurveKeys:
        try:
            public, secret = zmq.auth.load_certificate(secret_key_file)
            server_public, _ = zmq.auth.load_certificate(server_public_key_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"curve: cannot load key files: {exc}") from exc
        if secret is None:
            raise ConfigError(
                f"curve.server_secret_key_file: {secret_key_file!r} holds no secret key"
            )
        if not Path(client_public_keys_dir).is_dir():
            raise ConfigError(
                f"curve.client_public_keys_dir: {client_public_keys_dir!r} is not a directory"
            )
        return cls(public, secret, server_public, client_public_keys_dir)


@dataclass(frozen=True, slots=True)
class ZmqStatistics:
    links: int
    frames_received: int
    frames_sent: int
    frames_dropped: int
    links_lost: int
    links_parked: int


def _endpoint(peer_id: str) -> str:
    host, sep, port = peer_id.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host:
        raise PeerLost(f"peer id {peer_id!r} is not host:port")
    return f"tcp://{host}:{port}"


class ZmqControl:
    """A node's control endpoint: one ROUTER, one DEALER per peer."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        heartbeat_interval_s: float = 2.0,
        heartbeat_timeout_s: float = 10.0,
        max_frame_bytes: int = limits.MAX_FRAME_BYTES,
        max_queued_frames: int = 4096,
        max_link_bytes: int = 64 << 20,
        curve: CurveKeys | None = None,
        max_parked_links: int = MAX_PARKED_LINKS,
        park_s: float = PARK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._heartbeat = (int(heartbeat_interval_s * 1000), int(heartbeat_timeout_s * 1000))
        self._max_frame = max_frame_bytes
        self._max_queued = max_queued_frames
        self._max_link_bytes = max_link_bytes
        self._curve = curve
        self._parking = Parking(max_parked_links, park_s, clock, self._drop)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._ipv6 = ":" in host
        self._router = self._context.socket(zmq.ROUTER)
        self._configure(self._router)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + 4096)
        self._router.setsockopt(zmq.RCVHWM, 100_000)
        # Without CURVE, a second connection claiming an identity that is connected
        # already is not let in (ZMQ leaves it unread for good) while the first one is
        # held: no process can take a live peer's identity over. A restarted peer's old
        # connection closes with its process, so its new one is let in (after a host
        # crash: once the old connection's heartbeats expire). A live peer's next
        # session reuses its connection (rule 6). With CURVE every connection is an
        # allowed key's: the newest connection under an identity takes it over, so a
        # peer's fresh link is read at once even while we still hold its last one
        # (rule 7).
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1 if curve is not None else 0)
        # A connection that never completes the ZMQ handshake is closed after this.
        self._router.setsockopt(zmq.HANDSHAKE_IVL, ZMQ_HANDSHAKE_MS)
        if curve is not None:
            self._auth = ThreadAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=curve.clients_dir)
            self._router.curve_server = True
            self._router.curve_publickey = curve.public
            self._router.curve_secretkey = curve.secret
        bracketed = f"[{host}]" if self._ipv6 else host
        try:
            if port == 0:
                port = self._router.bind_to_random_port(f"tcp://{bracketed}")
            else:
                self._router.bind(f"tcp://{bracketed}:{port}")
        except zmq.ZMQError as exc:
            self._shutdown_context()
            raise ConfigError(f"cannot bind the control port {bracketed}:{port}: {exc}") from exc
        self._local_id = f"{bracketed}:{port}"
        self.port = port
        self._links: dict[int, ZmqLink] = {}
        self._answers: list[InboundFrame] = []  # frames peers sent back on our DEALERs
        self._monitor_seq = itertools.count()
        self._received = 0
        self._sent = 0
        self._dropped = 0
        self._lost = 0
        self._closed = False
        self._dirty = False  # a link has queued frames, or must be opened or released
        self._router_fd: int = self._router.fileno()
        self._descriptors: tuple[int, ...] = ()
        # Sockets used since the last pending(): link id -> link, 0 -> the ROUTER.
        self._touched: dict[int, ZmqLink | None] = {}
        self._refresh_descriptors()

    # -- ControlTransport ------------------------------------------------------------

    @property
    def local_id(self) -> str:
        return self._local_id

    def connect(self, peer_id: str) -> ZmqLink:
        if self._closed:
            raise PeerLost("control transport is closed")
        link = ZmqLink(self, peer_id, self._max_queued, self._max_link_bytes)
        self._links[id(link)] = link
        # Opened here, not by the next pump: a driver starved on a busy machine
        # delayed first contacts by up to ~70 ms. A failure leaves a dead link.
        if not self._adopt(link):
            self._open(link)
        self._refresh_descriptors()
        return link

    def flush(self) -> None:
        """Send queued frames, open and release sockets: a no-op unless a link
        queued a frame, closed or died since the last pump."""
        if self._closed or not self._dirty:
            return
        self._pump()

    def receive(self) -> list[InboundFrame]:
        """Pump: read the ROUTER, then every link (monitor, answers, queued frames)."""
        if self._closed:
            return []
        frames: list[InboundFrame] = []
        router = self._router
        self._touched[0] = None
        for _ in range(10_000):  # bounded: pending() says if more wait
            if not socket_events(router) & POLLIN:
                break
            try:
                parts = router.recv_multipart(NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(parts) != 2:
                self._dropped += 1
                continue
            try:
                peer_id = parts[0].bytes.decode("utf-8")
            except UnicodeDecodeError:
                self._dropped += 1
                continue
            try:
                address = parts[1].get("Peer-Address")
            except zmq.ZMQError:
                address = None
            source = address if isinstance(address, str) else None
            self._received += 1
            frames.append(InboundFrame(peer_id, parts[1].bytes, source))
        # Pumped after the ROUTER was read: an arrived frame goes to dispatch first.
        self._pump()
        frames.extend(self._answers)
        self._answers = []
        return frames

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self._links.values():
            link.closed = True
            link.release()
        self._links.clear()
        self._parking.clear()
        self._router.close(linger=0)
        self._shutdown_context()

    # -- the owner's loop (kvpeer.node.loop.Source) ------------------------------------

    @property
    def descriptors(self) -> tuple[int, ...]:
        """``ZMQ_FD`` of the ROUTER and of each live link's sockets (the same tuple
        until the set changes)."""
        return self._descriptors

    def pending(self) -> bool:
        """Whether work waits that :attr:`descriptors` will not announce (owner's
        lock held): frames queued for the pump, or a socket used since the last call
        that still has input, or queued frames and room to send them. The only
        place that re-checks ``ZMQ_EVENTS`` for the edge-triggered ``ZMQ_FD``
        (rule 1); after False, new work makes a descriptor readable."""
        if self._closed:
            return False
        touched = self._touched
        if not touched:
            return self._dirty
        self._touched = {}
        pending = self._dirty
        for key, link in touched.items():
            if key == 0:
                pending |= bool(socket_events(self._router) & POLLIN)
                continue
            assert link is not None
            sock, monitor = link.socket, link.monitor
            if sock is None or link.dead_reason is not None:
                continue
            events = socket_events(sock)
            pending |= bool(events & POLLIN or (link.queue and events & POLLOUT))
            if monitor is not None:
                pending |= bool(socket_events(monitor) & POLLIN)
        return pending

    def next_deadline(self) -> float | None:
        """When the oldest parked link is due to close (:meth:`receive` does it)."""
        return self._parking.next_deadline()

    def mark_dirty(self) -> None:
        """A link needs the pump (owner's lock held): :meth:`pending` says so."""
        self._dirty = True

    def send_now(self, link: ZmqLink, frame: bytes) -> bool:
        """Send ``frame`` on ``link``'s open socket without blocking (owner's lock
        held); False when it must be queued instead."""
        sock = link.socket
        if sock is None or not link.alive:
            return False
        try:
            sock.send(frame, NOBLOCK, copy=len(frame) < 65536)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            self._lose(link, f"send failed: {exc}")
            return True  # consumed: the link is dead now
        self._sent += 1
        link.sent(frame)
        self._touched[id(link)] = link  # the send may have eaten an inbound edge
        return True

    def statistics(self) -> ZmqStatistics:
        return ZmqStatistics(
            links=len(self._links) - len(self._parking),
            frames_received=self._received,
            frames_sent=self._sent,
            frames_dropped=self._dropped,
            links_lost=self._lost,
            links_parked=len(self._parking),
        )

    # -- internals -----------------------------------------------------------------------

    def _refresh_descriptors(self) -> None:
        """Gather :attr:`descriptors` (lock held); a new tuple only if they changed."""
        live = (link for link in self._links.values() if link.dead_reason is None)
        fds = (self._router_fd, *(fd for link in live for fd in link.fds))
        if fds != self._descriptors:
            self._descriptors = fds

    def _configure(self, sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        interval, timeout = self._heartbeat
        sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
        sock.setsockopt(zmq.HEARTBEAT_TTL, timeout)
        if self._ipv6:
            sock.setsockopt(zmq.IPV6, 1)

    def _pump(self) -> None:
        """Pump every link (what it leaves undone, :meth:`pending` says)."""
        self._dirty = False
        self._parking.expire()
        for link in list(self._links.values()):
            self._pump_link(link)
        self._refresh_descriptors()

    def _pump_link(self, link: ZmqLink) -> None:
        """Open, read, send, park or release one link."""
        if link.closed:
            if not link.parked:
                self._send_last_words(link)
                if not self._parking.park(link):
                    self._drop(link)
                    return
            self._tend_parked(link)
            return
        if link.dead_reason is not None:
            return
        if link.socket is None:
            self._open(link)
            if link.socket is None:
                return
        self._touched[id(link)] = link
        lost = link.loss()
        if lost is not None:
            self._lose(link, lost)
        self._read_answers(link)
        self._send_queued(link)

    def _send_queued(self, link: ZmqLink) -> None:
        sent, failed = link.send_queued()
        self._sent += sent
        if failed is not None:
            self._lose(link, failed)

    # -- parked links (rule 6: zmq_parking) -----------------------------------------------

    def _tend_parked(self, link: ZmqLink) -> None:
        """Watch a parked link: closed once lost; what the peer sends on it is
        dropped; its last words that did not fit yet still go out."""
        assert link.socket is not None
        self._touched[id(link)] = link
        if link.loss() is not None:
            self._drop(link)
            return
        self._dropped += len(link.read(64))  # answers to a session that ended
        self._send_queued(link)
        if link.dead_reason is not None:
            self._drop(link)

    def _adopt(self, link: ZmqLink) -> bool:
        """Give new ``link`` the connection of the peer's parked link, if any."""
        peer_id = link.peer_id
        for old in list(self._links.values()):
            if old.closed and not old.parked and old.peer_id == peer_id:
                self._pump_link(old)  # closed since the last pump: its last words, parked
        parked = self._parking.get(peer_id)
        if parked is None:
            return False
        self._tend_parked(parked)  # a loss that already arrived is seen now
        if self._parking.get(peer_id) is not parked:
            return False
        self._drop(parked, release=False)
        link.take_over(parked)
        self._touched[id(link)] = link  # reading it as parked may have eaten an edge
        if link.queue:
            self.mark_dirty()
        return True

    def _drop(self, link: ZmqLink, *, release: bool = True) -> None:
        """Forget closed ``link`` (and close its sockets unless ``release`` is off)."""
        if release:
            link.release()
        del self._links[id(link)]
        self._touched.pop(id(link), None)
        self._parking.forget(link)

    def _open(self, link: ZmqLink) -> None:
        try:
            endpoint = _endpoint(link.peer_id)
            sock = self._context.socket(zmq.DEALER)
            self._configure(sock)
            sock.setsockopt(zmq.IDENTITY, self._local_id.encode())
            sock.setsockopt(zmq.SNDHWM, LINK_HWM)
            # What a peer sends back on it (refusals; on a parked link, nothing we
            # read) is bounded like what it sends to the ROUTER.
            sock.setsockopt(zmq.RCVHWM, LINK_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame + 4096)
            if ":" in endpoint[6:].rpartition(":")[0]:
                sock.setsockopt(zmq.IPV6, 1)
            if self._curve is not None:
                sock.curve_publickey = self._curve.public
                sock.curve_secretkey = self._curve.secret
                sock.curve_serverkey = self._curve.server_public
            link.monitor = sock.get_monitor_socket(
                MONITOR_EVENTS, f"inproc://kvpeer-monitor-{next(self._monitor_seq)}"
            )
            sock.connect(endpoint)
        except (zmq.ZMQError, PeerLost) as exc:
            self._lose(link, f"cannot connect: {exc}")
            return
        link.socket = sock
        link.fds = (sock.fileno(), link.monitor.fileno())

    def refuse(self, peer_id: str, frame: bytes) -> None:
        """Answer on the peer's own connection (ROUTER -> its DEALER); never dial it."""
        if self._closed:
            return
        try:
            self._router.send_multipart([peer_id.encode("utf-8"), frame], NOBLOCK)
        except (zmq.ZMQError, UnicodeEncodeError):
            self._dropped += 1  # gone already, or its pipe is full: it was best effort
        self._touched[0] = None  # the send may have eaten an inbound edge

    def _read_answers(self, link: ZmqLink) -> None:
        """Frames a peer sent back on our DEALER (a refusal): delivered as from it."""
        for frame in link.read(64):
            self._received += 1
            self._answers.append(InboundFrame(link.peer_id, frame))

    def _send_last_words(self, link: ZmqLink) -> None:
        """Best effort: a closed link's frames (a ``disconnect``) still go out, queued
        ones and those sent at once that ZMQ may still hold (a fresh connection)."""
        if link.dead_reason is not None or (not link.queue and link.socket is None):
            return
        if link.socket is None:
            self._open(link)
        sock = link.socket
        if sock is None:
            return
        self._send_queued(link)  # what does not fit waits while the link is parked
        sock.setsockopt(zmq.LINGER, _LAST_WORDS_LINGER_MS)

    def lose(self, link: ZmqLink, reason: str) -> None:
        """Declare ``link`` dead (counted and logged once)."""
        self._lose(link, reason)

    def _lose(self, link: ZmqLink, reason: str) -> None:
        if link.dead_reason is None:
            link.dead_reason = reason
            self._dirty = True  # its descriptors leave the wait set
            self._lost += 1
            log.info("control link to %s lost: %s", link.peer_id, reason)

    def _shutdown_context(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._context.destroy(linger=0)
