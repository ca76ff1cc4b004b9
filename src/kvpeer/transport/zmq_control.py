"""The ZMQ control channel (PROTOCOL.md section 1).

One ROUTER bound on ``tcp://host:port`` receives every peer's frames as
``[identity, payload]``; one DEALER per peer, with our peer id as identity,
carries ours. Socket rules:

1. Only :meth:`ZmqControl.receive` (the pump) and :meth:`ZmqControl.close`
   touch sockets; the node calls both from its driver thread.
   :meth:`ZmqLink.transmit` and :meth:`ZmqControl.connect` only queue work
   and wake the driver, so the engine thread never blocks on a socket.
2. Every queue is bounded. A peer whose queue overflows (it stopped reading
   and the socket's high-water mark is full) is declared dead.
3. A DEALER that loses its connection after it was established (heartbeat
   timeout, peer closed) is dead; ZMQ's reconnect is not trusted to bring the
   same peer incarnation back - the session layer starts over instead.
4. ``MAXMSGSIZE`` bounds inbound frames; anything but two frames with a UTF-8
   identity is dropped and counted.
5. With CURVE, the ROUTER only accepts clients whose public key is in the
   allowed directory, and every DEALER authenticates the server's key.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvpeer.errors import ConfigError, PeerLost
from kvpeer.protocol import limits
from kvpeer.transport.base import InboundFrame

__all__ = ["CurveKeys", "ZmqControl", "ZmqLink", "ZmqStatistics"]

log = logging.getLogger("kvpeer.zmq")

_MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_LAST_WORDS_LINGER_MS = 200
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


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


def _endpoint(peer_id: str) -> str:
    host, sep, port = peer_id.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise PeerLost(f"peer id {peer_id!r} is not host:port")
    return f"tcp://{host}:{port}"


class ZmqLink:
    """Our DEALER toward one peer; frames queue here until the driver sends them."""

    def __init__(self, owner: ZmqControl, peer_id: str, max_queued: int) -> None:
        self._owner = owner
        self._peer_id = peer_id
        self._max_queued = max_queued
        self.queue: deque[bytes] = deque()
        self.socket: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.connected_once = False
        self.dead_reason: str | None = None
        self.closed = False

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and not self.closed

    def transmit(self, frame: bytes) -> bool:
        if not self.alive:
            return False
        if len(self.queue) >= self._max_queued:
            self._owner.lose(self, f"more than {self._max_queued} frames waiting to be sent")
            return False
        self.queue.append(frame)
        self._owner.wake()
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._owner.wake()


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
        curve: CurveKeys | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self._heartbeat = (int(heartbeat_interval_s * 1000), int(heartbeat_timeout_s * 1000))
        self._max_frame = max_frame_bytes
        self._max_queued = max_queued_frames
        self._curve = curve
        self._external_wake = wake
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._ipv6 = ":" in host
        self._router = self._context.socket(zmq.ROUTER)
        self._configure(self._router)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + 4096)
        self._router.setsockopt(zmq.RCVHWM, 100_000)
        # A restarted peer reconnects with the same identity: let the new connection
        # take it over at once (its connect then carries the new boot id).
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
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

    # -- ControlTransport ------------------------------------------------------------

    @property
    def local_id(self) -> str:
        return self._local_id

    def connect(self, peer_id: str) -> ZmqLink:
        if self._closed:
            raise PeerLost("control transport is closed")
        link = ZmqLink(self, peer_id, self._max_queued)
        self._links[id(link)] = link
        self.wake()
        return link

    def flush(self) -> None:
        """Open/close sockets, read monitors and send every queued frame."""
        if self._closed:
            return
        for link in list(self._links.values()):
            self._pump_link(link)

    def receive(self) -> list[InboundFrame]:
        """Pump: open/close sockets, send queued frames, read monitors and the ROUTER."""
        if self._closed:
            return []
        self._drain_wake()
        self.flush()
        frames, self._answers = self._answers, []
        for _ in range(10_000):  # bounded: the driver loops again if more wait
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
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
        return frames

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self._links.values():
            link.closed = True
            self._release(link)
        self._links.clear()
        self._router.close(linger=0)
        self._shutdown_context()

    # -- driver support ------------------------------------------------------------------

    def wake(self) -> None:
        """Make the driver's :meth:`wait` return (callable from any thread)."""
        if not self._closed:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake_fd, 1)
        if self._external_wake is not None:
            self._external_wake()

    def wait(self, timeout_s: float | None) -> None:
        """Block until a frame, a wake-up, or ``timeout_s`` (driver thread only)."""
        if self._closed:
            return
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_fd, zmq.POLLIN)
        for link in self._links.values():
            if link.monitor is not None:
                poller.register(link.monitor, zmq.POLLIN)
            if link.socket is not None:
                poller.register(link.socket, zmq.POLLIN | (zmq.POLLOUT if link.queue else 0))
        timeout = None if timeout_s is None else max(0, int(timeout_s * 1000))
        poller.poll(timeout)

    def statistics(self) -> ZmqStatistics:
        return ZmqStatistics(
            links=len(self._links),
            frames_received=self._received,
            frames_sent=self._sent,
            frames_dropped=self._dropped,
            links_lost=self._lost,
        )

    # -- internals -----------------------------------------------------------------------

    def _configure(self, sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        interval, timeout = self._heartbeat
        sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
        sock.setsockopt(zmq.HEARTBEAT_TTL, timeout)
        if self._ipv6:
            sock.setsockopt(zmq.IPV6, 1)

    def _pump_link(self, link: ZmqLink) -> None:
        if link.closed:
            self._send_last_words(link)
            self._release(link)
            del self._links[id(link)]
            return
        if link.dead_reason is not None:
            return
        if link.socket is None:
            self._open(link)
            if link.socket is None:
                return
        self._read_monitor(link)
        sock = link.socket
        self._read_answers(link, sock)
        while link.queue and link.alive:
            try:
                sock.send(link.queue[0], zmq.NOBLOCK, copy=len(link.queue[0]) < 65536)
            except zmq.Again:
                break  # high-water mark: try again on the next pump
            except zmq.ZMQError as exc:
                self._lose(link, f"send failed: {exc}")
                break
            link.queue.popleft()
            self._sent += 1

    def _open(self, link: ZmqLink) -> None:
        try:
            endpoint = _endpoint(link.peer_id)
            sock = self._context.socket(zmq.DEALER)
            self._configure(sock)
            sock.setsockopt(zmq.IDENTITY, self._local_id.encode())
            sock.setsockopt(zmq.SNDHWM, 1000)
            if ":" in endpoint[6:].rpartition(":")[0]:
                sock.setsockopt(zmq.IPV6, 1)
            if self._curve is not None:
                sock.curve_publickey = self._curve.public
                sock.curve_secretkey = self._curve.secret
                sock.curve_serverkey = self._curve.server_public
            link.monitor = sock.get_monitor_socket(
                _MONITOR_EVENTS, f"inproc://kvpeer-monitor-{next(self._monitor_seq)}"
            )
            sock.connect(endpoint)
        except (zmq.ZMQError, PeerLost) as exc:
            self._lose(link, f"cannot connect: {exc}")
            return
        link.socket = sock

    def _read_monitor(self, link: ZmqLink) -> None:
        monitor = link.monitor
        if monitor is None:
            return
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = int(event["event"])
            if kind == zmq.EVENT_CONNECTED:
                link.connected_once = True
            elif kind & _HANDSHAKE_FAILED:
                self._lose(link, "security handshake failed (CURVE keys?)")
                return
            elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and link.connected_once:
                self._lose(link, "connection lost")
                return

    def refuse(self, peer_id: str, frame: bytes) -> None:
        """Answer on the peer's own connection (ROUTER -> its DEALER); never dial it."""
        if self._closed:
            return
        try:
            self._router.send_multipart([peer_id.encode("utf-8"), frame], zmq.NOBLOCK)
        except (zmq.ZMQError, UnicodeEncodeError):
            self._dropped += 1  # gone already, or its pipe is full: it was best effort

    def _read_answers(self, link: ZmqLink, sock: zmq.Socket[bytes]) -> None:
        """Frames a peer sent back on our DEALER (a refusal): delivered as from it."""
        for _ in range(64):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            self._received += 1
            self._answers.append(InboundFrame(link.peer_id, frame))

    def _send_last_words(self, link: ZmqLink) -> None:
        """Best effort: a closed link's queued frames (a ``disconnect``) still go out."""
        if not link.queue or link.dead_reason is not None:
            return
        if link.socket is None:
            self._open(link)
        sock = link.socket
        if sock is None:
            return
        while link.queue:
            try:
                sock.send(link.queue.popleft(), zmq.NOBLOCK)
            except zmq.ZMQError:
                break
        sock.setsockopt(zmq.LINGER, _LAST_WORDS_LINGER_MS)

    def lose(self, link: ZmqLink, reason: str) -> None:
        """Declare ``link`` dead (counted and logged once)."""
        self._lose(link, reason)

    def _lose(self, link: ZmqLink, reason: str) -> None:
        if link.dead_reason is None:
            link.dead_reason = reason
            self._lost += 1
            log.info("control link to %s lost: %s", link.peer_id, reason)

    def _release(self, link: ZmqLink) -> None:
        if link.socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                link.socket.disable_monitor()
            link.socket.close()  # its LINGER: 0, or a moment for its last words
            link.socket = None
        if link.monitor is not None:
            link.monitor.close(linger=0)
            link.monitor = None

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake_fd)

    def _shutdown_context(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._context.destroy(linger=0)
        os.close(self._wake_fd)
