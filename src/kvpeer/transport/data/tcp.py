"""The ``tcp`` data plane: a byte stream from producer to consumer, acknowledged.

Every node listens on a data port (its offer: ``{"host", "port"}``). A producer that
chose ``tcp`` for a peer opens one connection to the peer's data port (``add_peer``, in a
thread of its own) and hands the peer a random token through the control channel
(``connect_ack``); the consumer's ``accept_writer`` binds that token to the peer's
:class:`~kvpeer.transport.data.base.WriteWindow`.

Stream protocol (all integers big-endian)::

    producer -> consumer, once:  b"KVPD"  u8 version (1)  u8 n  token (n ASCII bytes)
    producer -> consumer, per transfer:
                                 u64 transfer id  u32 count  count x u64 slot
                                 count x block_len bytes (the blocks, in slot order)
    consumer -> producer, per transfer:
                                 u64 transfer id  u8 status (0 written, 1 refused)

The hello carries only the token (16..255 printable ASCII characters): the producer's
backend does not know the peer id the consumer calls it by, and the token alone names
the registration. The connection may overtake the ``connect_ack`` that carries it.

Invariants:

1. The consumer checks every slot of a transfer (``< num_blocks`` and open in the
   window) before it receives any of its bytes, and receives each block straight into
   its row (``recv_into``, no staging copy). A refused transfer is answered with
   status 1 and the connection is closed: the producer fails everything outstanding.
2. The producer reports a transfer only when its ack arrives (success) or its
   connection dies (failure); every transfer is reported at most once, through
   ``poll`` of its peer. Cancelled transfers are never reported.
3. Transfers to one peer are sent in order on one connection; the producer sends
   straight from rows of its region (``sendall`` of memoryviews). A transfer of at
   most :data:`INLINE_BYTES` to an idle connection is sent by ``write_blocks``
   itself without blocking (``MSG_DONTWAIT``), which saves waking the writer
   thread; whatever the socket does not take at once, the writer thread sends.
   At most one thread sends on a connection at a time.
4. After ``remove_peer``/``close`` return, no inbound connection of that peer writes
   into our region again: the receiving thread is woken (``shutdown``) and waited for.
5. A writer whose connection died is replaced by a new connection (same token) at the
   next ``write_blocks``; nothing is resent.
6. Every socket is closed by the thread that uses it, after it stopped using it
   and no inline send is using it.
7. Nothing a peer names is dialed blindly: the producer dials the *peer's own host* (the
   host of ``peer_id``, which the node took from the operator, the router or the
   peer's control connection) at the port of its offer; the offer's host is ignored
   unless the backend was built with ``trust_offered_hosts`` (NAT). A port is an
   int in 1..65535 (not a bool).
8. Errors: whatever a peer sent that we cannot use (an offer, a token, a peer id)
   raises :class:`~kvpeer.errors.DataPlaneError`; our own failures (backend closed,
   cannot listen, cannot start a thread) raise :class:`~kvpeer.errors.LocalFault`.
   Nothing else escapes ``usable_with``, ``add_peer`` or ``accept_writer``. No socket
   is waited on with ``select()``, which fails past descriptor 1023.
9. Until it is bound, an inbound connection is *pending* and costs no thread: the
   listener's thread reads every hello (:mod:`~kvpeer.transport.data.tcpgate`). A
   connection not bound within ``hello_timeout_s`` of its accept is closed, however
   its bytes trickle in. At most 8 connections per source address (IPv6: per /64)
   and 64 in all are pending; a newcomer is always taken in, and the oldest pending
   connection of its source (if that source is full) or of the source holding the
   most (if all places are taken) is closed instead. So a flood from some addresses
   never shuts out a writer from another, and threads are one per bound connection.
10. A token binds at most one live connection, and one peer has at most one token
    (registering a new one stops the connections of the old). A hello whose token is
    unknown, or bound to a connection that still lives, waits (pending) and is closed
    at its deadline; once the bound connection ends (the consumer frees the token
    before the producer can see the end) the reconnect binds. Keepalives end dead
    connections whose host vanished, so their token is not held for ever.

The region must outlive the backend: close the backend before unmapping the region.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import itertools
import logging
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpeer.errors import DataPlaneError, LocalFault
from kvpeer.protocol import Connect, TransportOffer, limits
from kvpeer.session.ports import TransferEvent
from kvpeer.transport.data import tcpwire as wire
from kvpeer.transport.data.base import PrimaryRegion, WriteWindow
from kvpeer.transport.data.tcpgate import HelloGate, Verdict
from kvpeer.transport.data.tcprecv import Inbound, Received, receive_transfers, stop_receiving

__all__ = ["INLINE_BYTES", "SOCKET_BUFFER_BYTES", "TcpBackend", "TcpStatistics"]

log = logging.getLogger("kvpeer.tcp")

#: Kernel send/receive buffer of data sockets (capped by net.core.[rw]mem_max).
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
#: Transfers up to this size to an idle connection are sent by ``write_blocks`` itself
#: (the socket buffer takes them at once; waking the writer thread costs more).
INLINE_BYTES = 1024 * 1024

_MAX_SLOTS = limits.MAX_ITEMS  # a fetch names at most this many blocks
_JOIN_TIMEOUT_S = 5.0
_CONNECT_POLL_MS = 50


@dataclass(frozen=True, slots=True)
class TcpStatistics:
    writers: int  # peers we write into
    inbound: int  # connections bound to peers writing into us
    queued: int  # our transfers not sent yet
    in_flight: int  # our transfers (partly) sent, not acknowledged yet
    bytes_sent: int
    bytes_received: int
    acked: int  # transfers the peer acknowledged
    failed: int  # transfers reported as failed
    refused: int  # inbound transfers refused (slot not open)
    rejected_connections: int  # bad hello; token unknown or busy until the deadline
    pending: int  # inbound connections not bound to a peer (yet)
    evicted: int  # pending connections closed to make room for newcomers


class _State(enum.Enum):
    QUEUED = "queued"
    SENDING = "sending"  # bytes may be on the wire: busy until acked or the link dies
    DONE = "done"  # reported; waits for poll


@dataclass(slots=True)
class _Send:
    transfer_id: int
    peer_id: str
    header: bytes
    runs: list[tuple[int, int]]  # (first local slot, blocks) of contiguous local rows
    nbytes: int
    state: _State = _State.QUEUED
    abandoned: bool = False
    sent: int = 0  # bytes of header and blocks already handed to the socket


@dataclass(slots=True)
class _Writer:
    """Our connection into one peer (producer side)."""

    peer_id: str
    host: str  # what we dial: the peer's own host, or the one it offered (if trusted)
    port: int
    token: str
    num_blocks: int
    queue: deque[_Send] = field(default_factory=deque)
    inflight: dict[int, _Send] = field(default_factory=dict)  # sent or sending, not acked
    sock: socket.socket | None = None
    dead: bool = False
    inline: bool = False  # write_blocks is sending on sock (the writer thread waits)


@dataclass(slots=True)
class _Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    acked: int = 0
    failed: int = 0
    refused: int = 0


class TcpBackend:
    """Implements :class:`~kvpeer.transport.data.base.Backend` over TCP streams."""

    registers_slowly = False  # add_peer only hands a writer to its thread

    def __init__(
        self,
        region: PrimaryRegion,
        notify: Callable[[], None],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        hello_timeout_s: float = 5.0,
        connect_timeout_s: float = 10.0,
        socket_buffer: int | None = SOCKET_BUFFER_BYTES,
        trust_offered_hosts: bool = False,
    ) -> None:
        """``host``/``port``: where we listen (port 0: any free port); ``advertise_host``:
        the host our offer names instead of ``host`` (peers dial it only if they trust
        offered hosts); ``hello_timeout_s``: how long an inbound connection may take,
        from its accept, to bind; ``trust_offered_hosts``: dial the host a peer's offer
        names instead of the peer's own host (NAT; see invariant 7)."""
        self._region = region
        self._view = region.view.cast("B")  # our own view: released at close
        self._notify = notify
        self._connect_timeout_s = connect_timeout_s
        self._trust_offered_hosts = trust_offered_hosts
        self._buffer = socket_buffer
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._writers: dict[str, _Writer] = {}
        self._sends: dict[int, _Send] = {}
        self._events: dict[str, list[TransferEvent]] = {}
        self._tokens: dict[str, tuple[str, WriteWindow]] = {}  # token -> (peer, window)
        self._bound: dict[str, Inbound] = {}  # token -> its one live connection
        self._inbound: set[Inbound] = set()
        self._threads: set[threading.Thread] = set()
        self._counters = _Counters()
        self._closed = False
        try:
            listener = wire.listen(host, port, socket_buffer)
        except OSError as exc:
            raise LocalFault(f"tcp: cannot listen on {host!r} port {port}: {exc}") from exc
        self._host = advertise_host or host
        self._port: int = listener.getsockname()[1]
        self._gate = HelloGate(listener, hello_timeout_s, self._bind)
        try:
            self._start(self._gate.run, "kvpeer-tcp-listen")
        except LocalFault:
            self._gate.release()
            raise

    @property
    def name(self) -> str:
        return "tcp"

    @property
    def port(self) -> int:
        return self._port

    # -- negotiation ---------------------------------------------------------------------

    def offer(self) -> TransportOffer:
        return {"host": self._host, "port": self._port}

    def agent_metadata(self) -> bytes:
        return b""

    def usable_with(self, offer: TransportOffer | None, hello: Connect) -> bool:
        return wire.offered_port(offer) is not None and wire.offered_host(offer) is not None

    def add_peer(
        self, peer_id: str, hello: Connect, offer: TransportOffer | None
    ) -> TransportOffer:
        port, offered = wire.offered_port(offer), wire.offered_host(offer)
        if port is None or offered is None:
            raise DataPlaneError(f"tcp: {peer_id!r} offered no usable address: {offer!r:.200}")
        host = offered if self._trust_offered_hosts else wire.peer_host(peer_id)
        if host is None:
            raise DataPlaneError(f"tcp: peer id {peer_id!r:.200} names no host to dial")
        token = secrets.token_hex(16)
        with self._lock:
            if self._closed:
                raise LocalFault("tcp: backend is closed")
            self._drop_writer(peer_id, "peer registered again")
            self._open_writer(_Writer(peer_id, host, port, token, hello.num_blocks))
        return {"token": token}

    def accept_writer(self, peer_id: str, params: TransportOffer, window: WriteWindow) -> None:
        token = params.get("token") if isinstance(params, Mapping) else None
        if not isinstance(token, str) or not wire.valid_token(token):
            raise DataPlaneError(f"tcp: {peer_id!r} sent no valid token: {params!r:.200}")
        with self._lock:
            if self._closed:
                raise LocalFault("tcp: backend is closed")
            holder = self._tokens.get(token)
            if holder is not None and holder[0] != peer_id:
                raise DataPlaneError(f"tcp: {peer_id!r} sent a token another peer registered")
            stale = {t for t, (p, _) in self._tokens.items() if p == peer_id and t != token}
            for old in stale:
                del self._tokens[old]
            self._tokens[token] = (peer_id, window)
            replaced = [c for c in self._inbound if c.token in stale]
        self._gate.wake()  # a connection may be waiting for this token
        for conn in replaced:
            stop_receiving(conn)

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            for old in [t for t, (p, _) in self._tokens.items() if p == peer_id]:
                del self._tokens[old]
            self._drop_writer(peer_id, "peer removed")
            inbound = [c for c in self._inbound if c.peer_id == peer_id]
        for conn in inbound:
            stop_receiving(conn)

    def detach_peer(self, peer_id: str) -> Callable[[], None] | None:
        """All of :meth:`remove_peer`, now: waiting for the peer's receiving threads is
        what guarantees that none of its bytes lands in our region once this returns
        (the engine may reuse the slots); the socket shutdown makes that wait short."""
        self.remove_peer(peer_id)
        return None

    # -- transfers -----------------------------------------------------------------------

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        if len(local_slots) != len(remote_slots):
            raise DataPlaneError(
                f"tcp: {len(local_slots)} local slots but {len(remote_slots)} remote slots"
            )
        if len(remote_slots) > _MAX_SLOTS:
            raise DataPlaneError(
                f"tcp: {len(remote_slots)} blocks in one transfer (max {_MAX_SLOTS})"
            )
        with self._lock:
            if self._closed:
                raise LocalFault("tcp: backend is closed")
            writer = self._writers.get(peer_id)
            if writer is None:
                raise DataPlaneError(f"tcp: peer {peer_id!r} is not registered")
            wire.check_slots(local_slots, self._region.num_blocks, "local")
            wire.check_slots(remote_slots, writer.num_blocks, f"remote ({peer_id!r})")
            if writer.dead:  # reconnect: the peer still knows our token
                writer = _Writer(peer_id, writer.host, writer.port, writer.token, writer.num_blocks)
                self._open_writer(writer)
            transfer_id = next(self._ids)
            header = wire.HEADER.pack(transfer_id, len(remote_slots)) + struct.pack(
                f"!{len(remote_slots)}Q", *remote_slots
            )
            send = _Send(
                transfer_id,
                peer_id,
                header,
                wire.runs(local_slots),
                len(local_slots) * self._region.block_len,
            )
            self._sends[transfer_id] = send
            sock = writer.sock
            inline = (
                send.nbytes <= INLINE_BYTES
                and sock is not None
                and not writer.queue
                and not writer.inflight  # the writer thread may be sending one
            )
            if inline:
                send.state = _State.SENDING
                writer.inflight[transfer_id] = send
                writer.inline = True
            else:
                writer.queue.append(send)
                self._lock.notify_all()
        if inline:
            assert sock is not None
            self._send_inline(writer, sock, send)
        return transfer_id

    def _send_inline(self, writer: _Writer, sock: socket.socket, send: _Send) -> None:
        """Send what the socket takes without blocking; the writer thread sends the
        rest (and is the one to fail the connection if sending breaks)."""
        with contextlib.suppress(OSError):  # BlockingIOError included: the rest waits
            for view in self._views(send):
                offset = 0
                while offset < view.nbytes:
                    sent = sock.send(view[offset:], socket.MSG_DONTWAIT)
                    send.sent += sent
                    offset += sent
        with self._lock:
            writer.inline = False
            if send.sent == len(send.header) + send.nbytes:
                self._counters.bytes_sent += send.nbytes
            elif not writer.dead:
                writer.queue.appendleft(send)
            self._lock.notify_all()

    def _views(self, send: _Send) -> list[memoryview]:
        """What is left to send of ``send``: its header, then its rows."""
        block_len = self._region.block_len
        views = [memoryview(send.header)]
        views += [self._view[f * block_len : (f + n) * block_len] for f, n in send.runs]
        skip, rest = send.sent, []
        for view in views:
            if skip >= view.nbytes:
                skip -= view.nbytes
                continue
            rest.append(view[skip:])
            skip = 0
        return rest

    def poll(self, peer_id: str) -> list[TransferEvent]:
        with self._lock:
            events = self._events.pop(peer_id, [])
            for event in events:
                self._sends.pop(event.transfer_id, None)
        return events

    def cancel(self, transfer_ids: Sequence[int], *, wait: bool) -> list[int]:
        busy: list[int] = []
        with self._lock:
            for transfer_id in transfer_ids:
                send = self._sends.get(transfer_id)
                if send is None:
                    continue
                if send.state is _State.SENDING and wait:
                    busy.append(transfer_id)
                    continue
                del self._sends[transfer_id]
                if send.state is _State.QUEUED:
                    writer = self._writers.get(send.peer_id)
                    if writer is not None and send in writer.queue:
                        writer.queue.remove(send)
                elif send.state is _State.SENDING:
                    send.abandoned = True  # its bytes still go out; its ack is ignored
                else:
                    events = self._events.get(send.peer_id, [])
                    events[:] = [e for e in events if e.transfer_id != transfer_id]
        return busy

    def statistics(self) -> TcpStatistics:
        with self._lock:
            c = self._counters
            return TcpStatistics(
                writers=len(self._writers),
                inbound=len(self._bound),
                queued=sum(len(w.queue) for w in self._writers.values()),
                in_flight=sum(len(w.inflight) for w in self._writers.values()),
                bytes_sent=c.bytes_sent,
                bytes_received=c.bytes_received,
                acked=c.acked,
                failed=c.failed,
                refused=c.refused,
                rejected_connections=self._gate.counters.rejected,
                pending=self._gate.pending,
                evicted=self._gate.counters.evicted,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for writer in self._writers.values():
                self._kill_writer(writer, "backend closed", report=False)
            self._writers.clear()
            self._sends.clear()
            self._events.clear()
            self._tokens.clear()
            inbound = list(self._inbound)
            self._lock.notify_all()
        self._gate.close()
        for conn in inbound:
            stop_receiving(conn)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        while True:
            with self._lock:
                threads = [t for t in self._threads if t is not threading.current_thread()]
            if not threads:
                break
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            with self._lock:
                self._threads.difference_update(t for t in threads if not t.is_alive())
                if any(t.is_alive() for t in threads):
                    log.warning("tcp: %d data threads did not stop", len(self._threads))
                    break
        with self._lock:
            if not self._threads:
                self._view.release()

    # -- producer side -------------------------------------------------------------------

    def _open_writer(self, writer: _Writer) -> None:
        """Register ``writer`` and start its thread (lock held)."""
        self._start(lambda: self._write_loop(writer), f"kvpeer-tcp-w-{writer.peer_id}")
        self._writers[writer.peer_id] = writer

    def _write_loop(self, writer: _Writer) -> None:
        try:
            sock = self._connect(writer)
        except (OSError, wire.Closed) as exc:
            with self._lock:
                self._kill_writer(writer, f"cannot connect to {writer.host}:{writer.port}: {exc}")
            self._notify()
            return
        reader: threading.Thread | None = None
        try:
            with self._lock:
                if writer.dead:
                    return
                writer.sock = sock
                reader = self._start(lambda: self._ack_loop(writer, sock), "kvpeer-tcp-ack")
            while True:
                with self._lock:
                    self._lock.wait_for(lambda: (writer.queue and not writer.inline) or writer.dead)
                    if writer.dead:
                        return
                    send = writer.queue.popleft()
                    send.state = _State.SENDING
                    writer.inflight[send.transfer_id] = send
                for view in self._views(send):
                    sock.sendall(view)
                with self._lock:
                    self._counters.bytes_sent += send.nbytes
        except (OSError, LocalFault) as exc:
            with self._lock:
                self._kill_writer(writer, f"connection to {writer.peer_id!r} failed: {exc}")
            self._notify()
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            if reader is not None:
                reader.join()
            with self._lock:
                writer.sock = None  # no new inline send picks it up
                self._lock.wait_for(lambda: not writer.inline)
            sock.close()

    def _ack_loop(self, writer: _Writer, sock: socket.socket) -> None:
        ack = bytearray(wire.ACK.size)
        reason = "connection closed by the peer"
        try:
            while True:
                wire.recv_exact(sock, memoryview(ack))
                transfer_id, status = wire.ACK.unpack(ack)
                with self._lock:
                    send = writer.inflight.pop(transfer_id, None)
                    if send is None:
                        reason = f"peer acknowledged unknown transfer {transfer_id}"
                        break
                    if status != wire.WRITTEN:
                        writer.inflight[transfer_id] = send
                        reason = f"peer refused transfer {transfer_id} (a slot not open for us)"
                        break
                    if send.abandoned or writer.dead:
                        continue
                    send.state = _State.DONE
                    self._counters.acked += 1
                    self._events.setdefault(writer.peer_id, []).append(
                        TransferEvent(transfer_id, True)
                    )
                self._notify()
        except (OSError, wire.Closed) as exc:
            if not isinstance(exc, wire.Closed):
                reason = f"connection to {writer.peer_id!r} failed: {exc}"
        with self._lock:
            self._kill_writer(writer, reason)
        self._notify()

    def _drop_writer(self, peer_id: str, reason: str) -> None:
        """Forget our writer into ``peer_id`` and its transfers, unreported (lock held)."""
        writer = self._writers.pop(peer_id, None)
        if writer is not None:
            self._kill_writer(writer, reason, report=False)
        self._events.pop(peer_id, None)
        for transfer_id in [t for t, s in self._sends.items() if s.peer_id == peer_id]:
            del self._sends[transfer_id]

    def _kill_writer(self, writer: _Writer, reason: str, *, report: bool = True) -> None:
        """Fail everything ``writer`` still owes and wake its threads (lock held)."""
        if writer.dead:
            return
        writer.dead = True
        owed = [*writer.queue, *writer.inflight.values()]
        writer.queue.clear()
        writer.inflight.clear()
        for send in owed:
            if send.abandoned or not report or self._sends.get(send.transfer_id) is not send:
                continue
            send.state = _State.DONE
            self._counters.failed += 1
            self._events.setdefault(writer.peer_id, []).append(
                TransferEvent(send.transfer_id, False, f"tcp: {reason}")
            )
        if writer.sock is not None:
            with contextlib.suppress(OSError):
                writer.sock.shutdown(socket.SHUT_RDWR)
        self._lock.notify_all()

    def _connect(self, writer: _Writer) -> socket.socket:
        deadline = time.monotonic() + self._connect_timeout_s
        error: OSError = OSError(f"no address for {writer.host!r}")
        try:
            infos = socket.getaddrinfo(writer.host, writer.port, type=socket.SOCK_STREAM)
        except (UnicodeError, ValueError) as exc:  # e.g. a DNS label over 63 characters
            raise OSError(f"cannot resolve {writer.host!r}: {exc}") from exc
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                wire.tune(sock, self._buffer)
                sock.setblocking(False)
                poller = select.poll()  # not select(): it fails past descriptor 1023
                poller.register(sock, select.POLLOUT)
                code = sock.connect_ex(address)
                while code in (errno.EINPROGRESS, errno.EALREADY):
                    if writer.dead or self._closed:
                        raise wire.Closed("writer removed while connecting")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"connect timed out after {self._connect_timeout_s} s")
                    if poller.poll(_CONNECT_POLL_MS):
                        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, errno.errorcode.get(code, str(code)))
                sock.setblocking(True)
                token = writer.token.encode("ascii")
                sock.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, len(token)) + token)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
            except wire.Closed:
                sock.close()
                raise
        raise error

    # -- consumer side -------------------------------------------------------------------

    def _bind(self, sock: socket.socket, token: str, source: str) -> Verdict:
        """Bind a hello's connection to its token's peer (the gate's thread)."""
        with self._lock:
            if self._closed:
                return Verdict.REFUSE
            entry = self._tokens.get(token)
            if entry is None or token in self._bound:
                return Verdict.WAIT  # not registered yet, or its connection still lives
            peer_id, window = entry
            try:
                sock.setblocking(True)
                wire.keepalive(sock)
            except OSError:
                return Verdict.REFUSE
            conn = Inbound(sock, token, peer_id)
            try:
                self._start(lambda: self._receive_loop(conn, window), "kvpeer-tcp-r")
            except LocalFault as exc:
                log.warning("tcp: inbound connection of %r refused: %s", peer_id, exc)
                return Verdict.REFUSE
            self._bound[token] = conn
            self._inbound.add(conn)
        log.debug("tcp: inbound connection from %s bound to %r", source, peer_id)
        return Verdict.BOUND

    def _receive_loop(self, conn: Inbound, window: WriteWindow) -> None:
        sock = conn.sock
        try:
            self._receive_transfers(conn, window)
        except (OSError, wire.Closed) as exc:
            if not conn.closed:
                log.debug("tcp: inbound connection from %r ended: %s", conn.peer_id, exc)
        finally:
            conn.closed = True
            with self._lock:  # free the token before the producer can see the end
                self._inbound.discard(conn)
                if self._bound.get(conn.token) is conn:
                    del self._bound[conn.token]
            self._gate.wake()  # its reconnect may be waiting
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _receive_transfers(self, conn: Inbound, window: WriteWindow) -> None:
        receive_transfers(conn, window, self._view, self._region, self._count)

    def _count(self, transfer: Received) -> None:
        with self._lock:
            if transfer.refused:
                self._counters.refused += 1
            self._counters.bytes_received += transfer.nbytes

    # -- threads -------------------------------------------------------------------------

    def _start(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start a tracked daemon thread (lock held or not); LocalFault if we cannot."""

        def run() -> None:
            try:
                target()
            finally:
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # "can't start new thread"
                self._threads.discard(thread)
                raise LocalFault(f"tcp: cannot start a thread: {exc}") from exc
        return thread

    # -- grants (nothing of ours is handed out on proof: the peer only dials us) -------

    def grant(self, peer_id: str) -> None:
        """Nothing to do."""

    def revoke(self, peer_id: str) -> None:
        """Nothing to do."""
