"""The router's half of pulling ahead: a ``prefetch`` to the serving engine's tier.

When the router sends a request to an engine flagged ``ahead`` and names a source for
its prefix, it also tells that engine's kvpeer tier, on the tier's control port, to
fetch the prefix at once (:class:`kvpeer.protocol.Prefetch`: the source's peer id
and the prompt's tokens up to what the source holds). The tier stages the blocks
(:mod:`kvpeer.node.ahead`) while the request travels to the engine and waits for
its scheduler, so the lookup finds them in host memory.

Rules:

1. Nothing here blocks the event loop or waits for a tier: one DEALER per tier, sent
   to without blocking, at most :data:`SEND_HWM` frames queued; a prefetch that cannot
   leave at once is dropped and counted, and its request pulls the ordinary way.
2. Nothing waits for an answer. A tier answers only to refuse
   (:class:`kvpeer.protocol.PrefetchRefused`); refusals are read whenever a prefetch is
   sent, counted, and each distinct reason is logged once per tier. A tier that refuses
   because it will never obey this router (the sender is not one it trusts, or it
   stages nothing) is sent no more prefetches: engines pull ahead by default, and a
   tier that cannot should not cost the router a message per request.
3. The router's identity on the wire is ``kvpeer-router-`` and 16 random hex digits,
   new per process; a tier obeys by the address the connection comes from
   (``prefetch_from``), never by this name.
4. Sockets close with the router (linger 0).
5. Toward tiers that use CURVE (their ROUTER admits only client keys of their
   directory) the router connects with its own certificate and the tiers' server key
   (``prefetch_curve_key``, ``prefetch_curve_server_key``); a tier that does not admit
   it never reads its prefetches, which are then dropped once the queue is full.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq
import zmq.auth

from kvpeer.errors import ConfigError
from kvpeer.protocol import Codec, Prefetch, PrefetchRefused, limits
from kvpeer.router.policy import EngineSpec

__all__ = ["OUTCOMES", "CurveClient", "PrefetchSender"]

log = logging.getLogger("kvpeer.router")

SEND_HWM = 64  # frames queued toward one tier before prefetches are dropped
OUTCOMES = ("sent", "dropped", "refused")
_MAX_REASONS = 64  # distinct refusal reasons remembered per tier (rule 2)


def _never_obeys(reason: str) -> bool:
    """A refusal that every later prefetch to that tier would get too
    (kvpeer.node.ahead's words: the sender is not trusted, or nothing is staged)."""
    return "is not allowed (prefetch_from" in reason or "this node stages nothing" in reason


def format_peer_id(host: str, port: int) -> str:
    """``host:port`` as a tier names itself (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class CurveClient:
    """CURVE material of a router's prefetch sockets."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, key_file: str, server_key_file: str) -> CurveClient:
        """This router's certificate (with its secret key) and the tiers' server public key;
        a ConfigError names the file that cannot be used."""
        try:
            public, secret = zmq.auth.load_certificate(key_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"prefetch_curve_key: cannot load {key_file!r}: {exc}") from None
        if secret is None:
            raise ConfigError(f"prefetch_curve_key: {key_file!r} holds no secret key")
        try:
            server_public, _ = zmq.auth.load_certificate(server_key_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"prefetch_curve_server_key: cannot load {server_key_file!r}: {exc}"
            ) from None
        return cls(public, secret, server_public)


class PrefetchSender:
    """One DEALER per tier the router has sent a prefetch to."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        count: Callable[[str], None] | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        """``count(outcome)`` is called for each of :data:`OUTCOMES` as it happens;
        ``curve``: connect to the tiers with CURVE (rule 5)."""
        self._context = context or zmq.Context.instance()
        self._count = count
        self._curve = curve
        self._identity = f"kvpeer-router-{secrets.token_hex(8)}".encode()
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._codec = Codec()
        self._reasons: dict[str, set[str]] = {}
        self._barred: set[str] = set()  # tiers that will never obey (rule 2)
        self.counts: Counter[str] = Counter()
        self._closed = False

    def connect(self, tiers: Iterable[EngineSpec]) -> None:
        """Open the connection to each tier now: a DEALER queues nothing for a tier it
        is not connected to (``IMMEDIATE``), so the first prefetch would be dropped."""
        for tier in tiers:
            self._socket(format_peer_id(tier.peer_host, tier.peer_port))

    def _counted(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._count is not None:
            self._count(outcome)

    def send(self, tier: EngineSpec, kv_request_id: str, source: EngineSpec,
             tokens: list[int]) -> bool:  # fmt: skip
        """Ask ``tier`` to fetch ``tokens``' blocks from ``source`` now; False: dropped."""
        if self._closed or not tokens:
            return False
        tokens = tokens[: limits.MAX_PREFETCH_TOKENS]
        message = Prefetch(
            kv_request_id=kv_request_id[: limits.MAX_NAME_CHARS],
            source=format_peer_id(source.peer_host, source.peer_port),
            tokens=tuple(tokens),
        )
        address = format_peer_id(tier.peer_host, tier.peer_port)
        sock = self._socket(address)
        self._read_refusals(address, sock)
        if address in self._barred:
            return False
        try:
            sock.send(self._codec.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError:  # queue full (rule 1) or a socket error: the ordinary pull
            self._counted("dropped")
            return False
        self._counted("sent")
        return True

    def _socket(self, address: str) -> zmq.Socket[bytes]:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self._identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.RCVHWM, SEND_HWM)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a tier not connected
            sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)  # a refusal is small
            if self._curve is not None:
                sock.curve_publickey = self._curve.public
                sock.curve_secretkey = self._curve.secret
                sock.curve_serverkey = self._curve.server_public
            sock.connect(f"tcp://{address}")
            self._sockets[address] = sock
        return sock

    def _read_refusals(self, address: str, sock: zmq.Socket[bytes]) -> None:
        for _ in range(SEND_HWM):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            try:
                answer = self._codec.decode(frame)
            except Exception:
                continue
            if not isinstance(answer, PrefetchRefused):
                continue  # e.g. a disconnect from a tier that took us for a peer
            self._counted("refused")
            seen = self._reasons.setdefault(address, set())
            reason = answer.reason[:200]
            if reason not in seen and len(seen) < _MAX_REASONS:
                seen.add(reason)
                log.warning("tier %s refused a prefetch: %s", address, reason)
            if _never_obeys(reason) and address not in self._barred:
                self._barred.add(address)
                log.warning("tier %s does not obey this router's prefetches: none are sent "
                            "to it any more; requests it serves pull when its engine looks "
                            "(its allowed_peers must include this router, or give the "
                            "engine ahead=false)", address)  # fmt: skip

    def barred(self, address: str) -> bool:
        """``address``'s tier refused for good: it gets no prefetches (rule 2)."""
        return address in self._barred

    def refused_reasons(self, address: str) -> set[str]:
        return set(self._reasons.get(address, ()))

    def poll_refusals(self) -> None:
        """Read every tier's refusals now (tests, shutdown statistics)."""
        for address, sock in self._sockets.items():
            self._read_refusals(address, sock)

    def close(self) -> None:
        self._closed = True
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
