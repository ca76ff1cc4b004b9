"""Wire format and socket helpers of the ``tcp`` data plane (the stream protocol is
described in :mod:`kvpeer.transport.data.tcp`)."""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Mapping, Sequence

from kvpeer.errors import DataPlaneError

__all__ = [
    "ACK",
    "HEADER",
    "HELLO",
    "MAGIC",
    "REFUSED",
    "SLOT",
    "TOKEN_MAX",
    "TOKEN_MIN",
    "VERSION",
    "WRITTEN",
    "Closed",
    "check_slots",
    "keepalive",
    "listen",
    "offered_host",
    "offered_port",
    "peer_host",
    "recv_exact",
    "runs",
    "tune",
    "valid_token",
]

MAGIC = b"KVPD"
VERSION = 1
HELLO = struct.Struct("!4sBB")
HEADER = struct.Struct("!QI")
ACK = struct.Struct("!QB")
SLOT = struct.Struct("!Q")
WRITTEN, REFUSED = 0, 1
#: A token is 16..255 printable ASCII characters without spaces (its length is a u8).
TOKEN_MIN, TOKEN_MAX = 16, 255
_TOKEN = re.compile(rf"[!-~]{{{TOKEN_MIN},{TOKEN_MAX}}}")
#: A host name or address literal as an offer may carry it (no spaces, no controls).
_HOST = re.compile(r"[!-~]{1,253}")
#: Dead inbound connections (the producer's host vanished) are noticed within about
#: idle + interval x count seconds, which frees their token for a reconnect.
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTERVAL_S, _KEEPALIVE_COUNT = 15, 5, 3
#: Connections the kernel completes before we accept them (capped by net.core.somaxconn).
#: Queued ones cost no descriptor of ours; a short queue makes a burst of connections,
#: a flood's or a fleet's, wait out SYN retransmits of a second and more.
_BACKLOG = 1024


class Closed(Exception):
    """The connection ended (EOF, reset, or we shut it down)."""


def listen(host: str, port: int, buffer: int | None) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        if buffer is not None:  # accepted sockets inherit it (and the window scale)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
        sock.bind(address)
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def tune(sock: socket.socket, buffer: int | None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)


def keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", _KEEPALIVE_COUNT),
    ):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def recv_exact(sock: socket.socket, target: memoryview) -> None:
    while target.nbytes:
        received = sock.recv_into(target)
        if received == 0:
            raise Closed("connection closed")
        target = target[received:]


def valid_token(token: object) -> bool:
    return isinstance(token, str) and _TOKEN.fullmatch(token) is not None


def offered_port(offer: Mapping[str, object] | None) -> int | None:
    """The offer's port if it is an int in 1..65535 (a bool is not a port)."""
    port = offer.get("port") if isinstance(offer, Mapping) else None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    return port


def offered_host(offer: Mapping[str, object] | None) -> str | None:
    """The offer's host if it looks like a host name or address literal."""
    host = offer.get("host") if isinstance(offer, Mapping) else None
    if not isinstance(host, str) or _HOST.fullmatch(host) is None:
        return None
    return host


def peer_host(peer_id: str) -> str | None:
    """The host of a peer id ``host:port`` / ``[v6]:port``; None if it is neither."""
    host, sep, port = peer_id.rpartition(":")
    if not sep or not 0 < len(port) <= 5 or not port.isascii() or not port.isdigit():
        return None
    if not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None  # an IPv6 literal must be bracketed
    return host if _HOST.fullmatch(host) else None


def check_slots(slots: Sequence[int], limit: int, whose: str) -> None:
    for slot in slots:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < limit:
            raise DataPlaneError(f"tcp: {whose} slot {slot!r} outside 0..{limit - 1}")


def runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive rows as ``(first, count)``: one ``sendall``/``recv_into`` each."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and slot == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs
