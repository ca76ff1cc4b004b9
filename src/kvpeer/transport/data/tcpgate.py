"""The door of the ``tcp`` data port: accepting connections and reading their hellos.

Anyone who can reach the data port can connect, so until a connection has shown a
registered token it costs us one file descriptor and a few hundred bytes, never a
thread. One thread (the listener's) runs :meth:`HelloGate.run`: a poll loop over the
listening socket and every *pending* connection (accepted, not bound to a peer yet).

Rules:

1. A pending connection that is not bound within ``hello_timeout_s`` of its accept is
   closed. The deadline is absolute: bytes that trickle in do not extend it.
2. At most :data:`MAX_PENDING_PER_SOURCE` pending connections per source (an IPv4
   address, an IPv6 /64) and :data:`MAX_PENDING` in all. A newcomer is always taken
   in: if its source holds its share already, that source's oldest pending connection
   is closed; else, if all places are taken, the oldest pending connection of the
   source holding the most is closed. A flood from some addresses therefore never
   shuts out a writer from another.
3. The gate reads at most the hello (``KVPD``, version, token length, token) and not a
   byte more; a hello that is malformed ends its connection at once.
4. A complete hello is offered to ``bind`` at once and again after every :meth:`wake`
   (a token was registered, a bound connection ended) until its deadline. ``bind``
   takes the connection (``BOUND``: it is no longer the gate's), keeps it waiting
   (``WAIT``) or has it closed (``REFUSE``).
5. Sockets the gate closes are closed by its thread; :meth:`close` stops the loop, and
   the loop closes the listener and every pending connection on its way out.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import ipaddress
import logging
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpeer.transport.data.tcpwire import HELLO, MAGIC, TOKEN_MIN, VERSION, valid_token

__all__ = ["MAX_PENDING", "MAX_PENDING_PER_SOURCE", "HelloGate", "Verdict"]

log = logging.getLogger("kvpeer.tcp")

#: Pending connections (accepted, not bound to a peer yet) from one source / in all.
MAX_PENDING_PER_SOURCE = 8
MAX_PENDING = 64
_ACCEPTS_PER_WAKE = 64  # then the pending connections get their turn
_ACCEPT_BACKOFF_S = 0.1  # accept failed for want of descriptors: let some close first


class Verdict(enum.Enum):
    BOUND = "bound"  # bind took the connection
    WAIT = "wait"  # token not registered yet, or bound to a live connection
    REFUSE = "refuse"  # close it now


#: ``bind(sock, token, source)``; called on the gate's thread.
Bind = Callable[[socket.socket, str, str], Verdict]


@dataclass(slots=True, eq=False)
class _Pending:
    sock: socket.socket
    source: str  # the address as a peer is named by (logs)
    group: str  # what the per-source cap counts: the address, or its /64
    deadline: float
    hello: bytearray = field(default_factory=bytearray)
    need: int = HELLO.size  # bytes of the hello still to read
    token: str | None = None  # set once the hello is complete


@dataclass(slots=True)
class GateCounters:
    rejected: int = 0  # bad hello, no binding by the deadline, refused by bind
    evicted: int = 0  # closed to make room for a newcomer


class HelloGate:
    """Admission of inbound connections; see the module docstring."""

    def __init__(
        self,
        listener: socket.socket,
        hello_timeout_s: float,
        bind: Bind,
    ) -> None:
        """The gate owns ``listener`` from now on (:meth:`run` closes it)."""
        self._listener = listener
        self._hello_timeout_s = hello_timeout_s
        self._bind = bind
        self._pending: dict[socket.socket, _Pending] = {}  # in accept order
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_lock = threading.Lock()  # no wake-up into a closed (reused) descriptor
        self._selector = _selector()
        self._stopped = False
        self._paused_until: float | None = None  # listener unwatched (out of descriptors)
        self.counters = GateCounters()  # written by the gate's thread only

    @property
    def pending(self) -> int:
        return len(self._pending)

    def wake(self) -> None:
        """Offer the waiting hellos to ``bind`` again (any thread)."""
        with self._wake_lock, contextlib.suppress(OSError):
            if self._wake_w.fileno() != -1:
                self._wake_w.send(b"w")  # BlockingIOError: a wake-up is pending already

    def close(self) -> None:
        """Make :meth:`run` return (any thread); it closes what it owns on the way out."""
        self._stopped = True
        self.wake()

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        selector = self._selector
        try:
            self._listener.setblocking(False)
            selector.register(self._wake_r, selectors.EVENT_READ)
            selector.register(self._listener, selectors.EVENT_READ)
            while not self._stopped:
                events = selector.select(self._timeout())
                retry = False
                for key, _ in events:
                    if key.fileobj is self._wake_r:
                        retry = True
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    elif key.fileobj is self._listener:
                        self._accept(selector)
                    else:
                        pending: _Pending = key.data
                        if self._pending.get(pending.sock) is pending:  # not evicted just now
                            self._read(selector, pending)
                if self._stopped:
                    return
                if retry:
                    for pending in [p for p in self._pending.values() if p.token is not None]:
                        self._offer(selector, pending)
                self._expire(selector)
        finally:
            self.release()

    def release(self) -> None:
        """Close everything the gate owns (done by :meth:`run` on its way out; call it
        yourself only if ``run`` never started)."""
        self._selector.close()
        for pending in self._pending.values():
            pending.sock.close()
        self._pending.clear()
        self._listener.close()
        with self._wake_lock:
            self._wake_r.close()
            self._wake_w.close()

    def _timeout(self) -> float | None:
        deadlines = [p.deadline for p in self._pending.values()]
        if self._paused_until is not None:
            deadlines.append(self._paused_until)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _accept(self, selector: selectors.BaseSelector) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("tcp: accept failed: %s", exc)
                    return
                # The connection stays queued and the listener readable: stop watching
                # it for a moment rather than spin.
                log.warning("tcp: accept failed, pausing: %s", exc)
                selector.unregister(self._listener)
                self._paused_until = time.monotonic() + _ACCEPT_BACKOFF_S
                return
            self._admit(selector, sock, address)

    def _admit(
        self, selector: selectors.BaseSelector, sock: socket.socket, address: object
    ) -> None:
        source, group = _source(address)
        mine = [p for p in self._pending.values() if p.group == group]
        if len(mine) >= MAX_PENDING_PER_SOURCE:
            self._evict(selector, mine[0], f"{source} holds {len(mine)} pending connections")
        elif len(self._pending) >= MAX_PENDING:
            counts = Counter(p.group for p in self._pending.values())
            most = max(counts.values())
            victim = next(p for p in self._pending.values() if counts[p.group] == most)
            self._evict(selector, victim, f"{len(self._pending)} pending connections")
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pending = _Pending(sock, source, group, time.monotonic() + self._hello_timeout_s)
            selector.register(sock, selectors.EVENT_READ, pending)
        except (OSError, ValueError) as exc:
            log.debug("tcp: inbound connection from %s dropped: %s", source, exc)
            sock.close()
            return
        self._pending[sock] = pending

    def _read(self, selector: selectors.BaseSelector, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(pending.need)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._reject(selector, pending, f"failed before its hello: {exc}")
            return
        if not data:
            self._reject(selector, pending, "closed before its hello")
            return
        pending.hello += data
        pending.need -= len(data)
        if pending.need:
            return
        if len(pending.hello) == HELLO.size:
            magic, version, size = HELLO.unpack(pending.hello)
            if magic != MAGIC or version != VERSION or size < TOKEN_MIN:
                self._reject(selector, pending, f"bad hello {bytes(pending.hello)!r}")
                return
            pending.need = size
            return
        token = bytes(pending.hello[HELLO.size :]).decode("ascii", "replace")
        if not valid_token(token):
            self._reject(selector, pending, "bad token in its hello")
            return
        pending.token = token
        selector.unregister(pending.sock)  # what follows the hello is not ours to read
        self._offer(selector, pending)

    def _offer(self, selector: selectors.BaseSelector, pending: _Pending) -> None:
        assert pending.token is not None
        verdict = self._bind(pending.sock, pending.token, pending.source)
        if verdict is Verdict.BOUND:
            del self._pending[pending.sock]
        elif verdict is Verdict.REFUSE:
            self._reject(selector, pending, "refused")

    def _expire(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            selector.register(self._listener, selectors.EVENT_READ)
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            why = "no hello" if pending.token is None else "its token was not free to bind"
            self._reject(selector, pending, f"{why} within {self._hello_timeout_s} s")

    def _evict(self, selector: selectors.BaseSelector, pending: _Pending, why: str) -> None:
        log.debug("tcp: pending connection from %s closed for a newcomer: %s", pending.source, why)
        self.counters.evicted += 1
        self._drop(selector, pending)

    def _reject(self, selector: selectors.BaseSelector, pending: _Pending, why: str) -> None:
        log.debug("tcp: inbound connection from %s rejected: %s", pending.source, why)
        self.counters.rejected += 1
        self._drop(selector, pending)

    def _drop(self, selector: selectors.BaseSelector, pending: _Pending) -> None:
        del self._pending[pending.sock]
        if pending.token is None:  # registered until its hello is complete
            selector.unregister(pending.sock)
        pending.sock.close()


def _selector() -> selectors.BaseSelector:
    """epoll (or poll, kqueue); never ``select()``, which fails past descriptor 1023."""
    default: type[selectors.BaseSelector] = selectors.DefaultSelector
    return selectors.PollSelector() if default is selectors.SelectSelector else default()


def _source(address: object) -> tuple[str, str]:
    """(the address, the group the per-source cap counts) of an accepted peer."""
    host = str(address[0]) if isinstance(address, tuple) and address else "?"
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host, host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped), str(ip.ipv4_mapped)
        return host, str(ipaddress.IPv6Network((ip, 64), strict=False))
    return host, host
