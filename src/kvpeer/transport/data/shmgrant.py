"""The shm plane's same-host proof: a region's file descriptor, handed over a Unix socket.

A region owner (the consumer) listens on an abstract-namespace Unix socket
``"\\0kvpeer-shm-" + <32 hex>`` (:class:`GrantServer`); its ``shm`` offer names only
that hex. A producer that wants to write into the region connects to it
(:func:`request_region`), says who it is and whom it means, and receives the region's
open file descriptor with ``SCM_RIGHTS``. Nothing a peer sends over the network is
ever opened: the producer opens no path, and the socket name it dials is rebuilt from
32 validated hex characters under our own prefix.

Why a remote peer cannot forge it:

1. An abstract socket exists only inside one network namespace of one kernel; a
   process elsewhere can name one but never reach it. A file descriptor cannot cross
   the network at all.
2. Both ends learn the other's pid and uid from the kernel (``SO_PEERCRED``), never
   from bytes: a uid outside ``allowed_uids`` is refused, and so is our own pid unless
   ``same_process`` (several nodes in one process, as tests build them).
3. The owner hands its descriptor only to a producer it has *granted* (the node
   grants a peer id when it opens a session toward that peer, before it sends the peer
   this offer, and revokes it when the session ends), and only when the request is
   addressed to the owner's own control identity. A peer that relays a third node's
   offer therefore makes the producer ask that node for a region on behalf of a
   session the node never had with it: refused, and the producer tries its next plane.
4. A descriptor carries the access its owner opened it with: a process can pass
   only what it could open itself, so no one gains a file through us.

Bounds: one request (at most :data:`MAX_REQUEST_BYTES`) and one reply per connection;
the server holds at most :data:`MAX_PENDING` connections, each for at most
:data:`SERVE_TIMEOUT_S`; a producer waits at most its ``timeout_s`` in total, reads at
most :data:`MAX_FDS` descriptors and closes every one it does not keep.
"""

from __future__ import annotations

import array
import contextlib
import errno
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass

from kvpeer.errors import DataPlaneError, LocalFault

__all__ = [
    "MAX_FDS",
    "MAX_PENDING",
    "MAX_REQUEST_BYTES",
    "SERVE_TIMEOUT_S",
    "SOCKET_PREFIX",
    "CredentialPolicy",
    "Credentials",
    "GrantServer",
    "GrantStatistics",
    "decode_request",
    "encode_request",
    "is_socket_name",
    "peer_credentials",
    "request_region",
]

log = logging.getLogger("kvpeer.shm")

#: Abstract-namespace prefix (the leading NUL); the rest of the name is 32 hex.
SOCKET_PREFIX = "\0kvpeer-shm-"
_NAME_CHARS = 32
_HEX = frozenset("0123456789abcdef")
_MAGIC = b"kvpeer-shm/1"
#: A peer id is at most 512 characters (docs/protocol.md section 5), 4 bytes each in UTF-8.
_MAX_ID_BYTES = 2048
_LENGTHS = struct.Struct("!HH")
MAX_REQUEST_BYTES = len(_MAGIC) + _LENGTHS.size + 2 * _MAX_ID_BYTES
_MAX_REASON_BYTES = 256
_GRANTED = b"\x00"
_REFUSED = b"\x01"
#: Descriptors a producer reads from one reply (it keeps exactly one).
MAX_FDS = 4
#: Connections the server holds at once, and how long each may take.
MAX_PENDING = 16
SERVE_TIMEOUT_S = 0.5
_BACKLOG = 16
#: After a failed accept (out of descriptors): stop polling the listener this long,
#: or its still-pending connection would wake us in a loop.
_ACCEPT_PAUSE_S = 0.1
_JOIN_TIMEOUT_S = 10.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def is_socket_name(value: object) -> bool:
    """True for exactly 32 lowercase hex characters (the only names we dial)."""
    return isinstance(value, str) and len(value) == _NAME_CHARS and set(value) <= _HEX


def _address(name: str) -> str:
    if not is_socket_name(name):
        raise DataPlaneError(f"shm: {name!r} is not a socket name")
    return SOCKET_PREFIX + name


@dataclass(frozen=True, slots=True)
class Credentials:
    """Who the kernel says is at the other end of a Unix socket."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> Credentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return Credentials(pid, uid, gid)


@dataclass(frozen=True, slots=True)
class CredentialPolicy:
    """Which processes may exchange regions with us: ``allowed_uids``, and never our
    own process unless ``same_process``."""

    allowed_uids: frozenset[int]
    same_process: bool = False

    def refusal(self, credentials: Credentials) -> str | None:
        """Why a process with ``credentials`` is refused, or None."""
        if credentials.pid <= 0:
            return "the kernel reported no process"
        if credentials.pid == os.getpid() and not self.same_process:
            return "the other end is this very process"
        if credentials.uid not in self.allowed_uids:
            return f"uid {credentials.uid} is not allowed"
        return None


def encode_request(producer: str, consumer: str) -> bytes:
    """The producer's request: who asks (``producer``) and whom (``consumer``)."""
    who, whom = producer.encode(), consumer.encode()
    if not 0 < len(who) <= _MAX_ID_BYTES or not 0 < len(whom) <= _MAX_ID_BYTES:
        raise DataPlaneError("shm: a peer id is empty or too long for a region request")
    return _MAGIC + _LENGTHS.pack(len(who), len(whom)) + who + whom


def decode_request(data: bytes) -> tuple[str, str] | None:
    """``(producer, consumer)`` of a well-formed request, else None."""
    if len(data) > MAX_REQUEST_BYTES or not data.startswith(_MAGIC):
        return None
    header = len(_MAGIC) + _LENGTHS.size
    if len(data) < header:
        return None
    who_len, whom_len = _LENGTHS.unpack_from(data, len(_MAGIC))
    if not 0 < who_len <= _MAX_ID_BYTES or not 0 < whom_len <= _MAX_ID_BYTES:
        return None
    if len(data) != header + who_len + whom_len:
        return None
    try:
        who = data[header : header + who_len].decode()
        whom = data[header + who_len :].decode()
    except UnicodeDecodeError:
        return None
    return who, whom


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def request_region(
    name: str, *, producer: str, consumer: str, policy: CredentialPolicy, timeout_s: float
) -> int:
    """The region descriptor of the owner serving ``name``, asked for as ``producer``
    on behalf of our session with ``consumer``; raises :class:`DataPlaneError` (with the
    owner's reason when it refused). The caller owns (and must close) the descriptor."""
    address = _address(name)
    request = encode_request(producer, consumer)
    deadline = time.monotonic() + timeout_s

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        return left

    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(remaining())
            sock.connect(address)
            refusal = policy.refusal(peer_credentials(sock))
            if refusal is not None:
                raise DataPlaneError(f"shm: region owner refused by us: {refusal}")
            sock.settimeout(remaining())
            sock.send(request)
            sock.settimeout(remaining())
            message, ancillary, flags, _ = sock.recvmsg(
                _MAX_REASON_BYTES + 2,
                socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize),
                socket.MSG_CMSG_CLOEXEC,
            )
    except DataPlaneError:
        raise
    except (OSError, ValueError) as exc:  # TimeoutError, refused, reset, no such socket
        raise DataPlaneError(f"shm: no region from socket {name}: {exc}") from exc
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[: len(data) - len(data) % received.itemsize])
            fds.extend(received)
    if message[:1] == _REFUSED:
        _close_all(fds)
        reason = message[1 : 1 + _MAX_REASON_BYTES].decode(errors="replace")
        raise DataPlaneError(f"shm: the region owner refused: {reason}")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or message != _GRANTED or len(fds) != 1:
        _close_all(fds)
        raise DataPlaneError(
            f"shm: malformed answer from socket {name} "
            f"({len(message)} bytes, {len(fds)} descriptors, flags {flags:#x})"
        )
    return fds[0]


@dataclass(frozen=True, slots=True)
class _Pending:
    """An accepted connection waiting for its request."""

    conn: socket.socket
    deadline: float
    refusal: str | None  # decided from its credentials already


@dataclass(frozen=True, slots=True)
class GrantStatistics:
    granted: int  # peer ids that may receive our region now
    served: int  # descriptors handed out
    refused: int  # requests refused


class GrantServer:
    """Serves one region descriptor to granted producers on an abstract Unix socket.

    Invariants:

    1. The descriptor goes out only in answer to a well-formed request, addressed to
       ``local_id``, from a granted peer id, over a connection whose kernel-reported
       credentials pass ``policy``; every refusal is answered with a short reason.
    2. One thread serves every connection with ``poll``: at most :data:`MAX_PENDING`
       at a time (the rest wait in the kernel's backlog), each closed after one
       answer or :data:`SERVE_TIMEOUT_S`.
    3. ``grant``/``revoke`` never block on the serving thread and never raise.
    4. ``close`` stops the thread before it returns; the descriptor stays the
       caller's (it is never closed here).
    """

    def __init__(self, region_fd: int, *, local_id: str, policy: CredentialPolicy) -> None:
        self._fd = region_fd
        self._local_id = local_id
        self._policy = policy
        self._lock = threading.Lock()
        self._grants: set[str] = set()
        self._served = 0
        self._refused = 0
        self._closed = False
        self.name, self._listener = _listen()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="kvpeer-shm-grant", daemon=True)
        self._thread.start()

    def grant(self, peer_id: str) -> None:
        with self._lock:
            if not self._closed:
                self._grants.add(peer_id)

    def revoke(self, peer_id: str) -> None:
        with self._lock:
            self._grants.discard(peer_id)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def statistics(self) -> GrantStatistics:
        with self._lock:
            return GrantStatistics(len(self._grants), self._served, self._refused)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._grants.clear()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT_S)
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the serving thread ----------------------------------------------------------

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        listener = self._listener.fileno()
        poller.register(listener, select.POLLIN)
        pending: dict[int, _Pending] = {}
        paused_until = 0.0
        try:
            while True:
                wakeups = [p.deadline for p in pending.values()]
                if paused_until:
                    wakeups.append(paused_until)
                wait_ms = -1
                if wakeups:
                    wait_ms = max(0, int((min(wakeups) - time.monotonic()) * 1000) + 1)
                ready = poller.poll(wait_ms)
                with self._lock:
                    if self._closed:
                        return
                for fd, _ in ready:
                    if fd == listener and not self._accept(poller, pending):
                        paused_until = time.monotonic() + _ACCEPT_PAUSE_S
                    elif fd in pending:
                        waiting = pending.pop(fd)
                        poller.unregister(fd)
                        with waiting.conn:
                            self._answer(waiting)
                now = time.monotonic()
                for fd in [fd for fd, p in pending.items() if p.deadline <= now]:
                    poller.unregister(fd)
                    self._count_refusal()  # before it goes: the peer may look at once
                    pending.pop(fd).conn.close()
                if paused_until and now >= paused_until:
                    paused_until = 0.0
                # Full (or paused): leave further connections in the kernel's backlog
                # until a slot frees up (they wait; nothing is refused for being early).
                listening = len(pending) < MAX_PENDING and not paused_until
                poller.modify(listener, select.POLLIN if listening else 0)
        except Exception:
            # A bug: stop answering at once (peers then fail fast and pick another
            # plane) instead of leaving connections to pile up in the backlog.
            log.exception("shm: the region server stopped")
            self._listener.close()
            raise
        finally:
            for waiting in pending.values():
                waiting.conn.close()

    def _accept(self, poller: select.poll, pending: dict[int, _Pending]) -> bool:
        """Accept what waits, up to the cap; False if accepting failed (pause)."""
        while len(pending) < MAX_PENDING:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:  # e.g. out of descriptors: the others still get served
                log.warning("shm: cannot accept a region request: %s", exc)
                return False
            conn.setblocking(False)
            try:
                refusal = self._policy.refusal(peer_credentials(conn))
            except OSError as exc:
                refusal = f"no credentials: {exc}"
            # Even a refused process gets its answer after its request: closing a
            # socket with unread data would reset the connection, reason unread.
            pending[conn.fileno()] = _Pending(conn, time.monotonic() + SERVE_TIMEOUT_S, refusal)
            poller.register(conn.fileno(), select.POLLIN)
        return True

    def _answer(self, waiting: _Pending) -> None:
        conn = waiting.conn
        try:
            data = conn.recv(MAX_REQUEST_BYTES + 1)
        except OSError:
            self._count_refusal()
            return
        if waiting.refusal is not None:
            self._refuse(conn, waiting.refusal)
            return
        request = decode_request(data)
        if request is None:
            self._refuse(conn, "malformed request")
            return
        producer, consumer = request
        with self._lock:
            granted = producer in self._grants
        if not granted:
            self._refuse(conn, f"{producer!r} holds no session with {self._local_id!r}")
            return
        if consumer != self._local_id:
            self._refuse(conn, f"this region belongs to {self._local_id!r}, not {consumer!r}")
            return
        with self._lock:
            self._served += 1  # before it goes: the producer may look at once
        try:
            conn.sendmsg(
                [_GRANTED], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self._fd]))]
            )
        except OSError as exc:
            log.info("shm: could not hand our region to %r: %s", producer, exc)
            with self._lock:
                self._served -= 1
                self._refused += 1

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        log.info("shm: region request refused: %s", reason)
        self._count_refusal()
        with contextlib.suppress(OSError):
            conn.send(_REFUSED + reason.encode()[:_MAX_REASON_BYTES])

    def _count_refusal(self) -> None:
        with self._lock:
            self._refused += 1


def _listen() -> tuple[str, socket.socket]:
    """A listening socket under a fresh random name (and that name)."""
    for _ in range(8):
        name = secrets.token_hex(_NAME_CHARS // 2)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(SOCKET_PREFIX + name)
            listener.listen(_BACKLOG)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE:
                continue
            raise LocalFault(f"shm: cannot listen for region requests: {exc}") from exc
        return name, listener
    raise LocalFault("shm: no free socket name after 8 tries")
