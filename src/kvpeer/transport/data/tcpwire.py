"""Wire format and socket helpers of the ``tcp`` data plane (the stream protocol is
described in :mod:`kvpeer.transport.data.tcp`)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from kvpeer.errors import DataPlaneError
from kvpeer.protocol import TransportOffer

__all__ = [
    "ACK",
    "HEADER",
    "HELLO",
    "MAGIC",
    "REFUSED",
    "SLOT",
    "VERSION",
    "WRITTEN",
    "Closed",
    "address",
    "check_slots",
    "listen",
    "recv_exact",
    "runs",
    "tune",
]

MAGIC = b"KVPD"
VERSION = 1
HELLO = struct.Struct("!4sBB")
HEADER = struct.Struct("!QI")
ACK = struct.Struct("!QB")
SLOT = struct.Struct("!Q")
WRITTEN, REFUSED = 0, 1


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
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def tune(sock: socket.socket, buffer: int | None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)


def recv_exact(sock: socket.socket, target: memoryview) -> None:
    while target.nbytes:
        received = sock.recv_into(target)
        if received == 0:
            raise Closed("connection closed")
        target = target[received:]


def address(offer: TransportOffer | None) -> tuple[str, int] | None:
    if offer is None:
        return None
    host, port = offer.get("host"), offer.get("port")
    if not isinstance(host, str) or not host or isinstance(port, bool):
        return None
    if not isinstance(port, int) or not 0 < port < 65536:
        return None
    return host, port


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
