"""The consumer side of the ``tcp`` data plane: receiving a peer's transfers into our
region (invariants 1 and 4 of :mod:`kvpeer.transport.data.tcp`).

One thread per bound inbound connection runs :func:`receive_transfers`. Every slot of a
transfer is checked (inside the region, open in the peer's write window) before any of
its bytes are received; blocks go straight into their rows (``recv_into``, no staging
copy). A refused transfer is answered with status 1 and receiving ends.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpeer.protocol import limits
from kvpeer.transport.data.base import PrimaryRegion, WriteWindow
from kvpeer.transport.data.tcpwire import (
    ACK,
    HEADER,
    REFUSED,
    SLOT,
    WRITTEN,
    Closed,
    recv_exact,
    runs,
)

__all__ = ["Inbound", "Received", "receive_transfers", "stop_receiving"]

log = logging.getLogger("kvpeer.tcp")

_MAX_SLOTS = limits.MAX_ITEMS  # a fetch names at most this many blocks


@dataclass(slots=True, eq=False)
class Inbound:
    """A connection a peer writes into us with (consumer side)."""

    sock: socket.socket
    token: str
    peer_id: str
    recv_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


@dataclass(frozen=True, slots=True)
class Received:
    """What one transfer did to our counters: bytes written, or refused."""

    nbytes: int
    refused: bool = False


def receive_transfers(
    conn: Inbound,
    window: WriteWindow,
    view: memoryview,
    region: PrimaryRegion,
    count: Callable[[Received], None],
) -> None:
    """Receive transfers on ``conn`` into ``view`` until the peer stops, a transfer is
    refused (returns) or receiving is stopped (:class:`Closed`, OSError)."""
    sock = conn.sock
    header = bytearray(HEADER.size)
    num_blocks, block_len = region.num_blocks, region.block_len
    while True:
        recv_exact(sock, memoryview(header))
        transfer_id, blocks = HEADER.unpack(header)
        if blocks > _MAX_SLOTS:
            _refuse(conn, transfer_id, f"{blocks} blocks in one transfer", count)
            return
        raw = bytearray(blocks * SLOT.size)
        recv_exact(sock, memoryview(raw))
        slots = struct.unpack(f"!{blocks}Q", raw)
        bad = next((s for s in slots if s >= num_blocks or not window.allows(s)), None)
        if bad is not None:
            _refuse(conn, transfer_id, f"slot {bad} is not open for its writes", count)
            return
        for first, run in runs(slots):
            target = view[first * block_len : (first + run) * block_len]
            with conn.recv_lock:
                if conn.closed:
                    raise Closed("receiving stopped")
                recv_exact(sock, target)
        count(Received(blocks * block_len))
        sock.sendall(ACK.pack(transfer_id, WRITTEN))


def stop_receiving(conn: Inbound) -> None:
    """Wake ``conn``'s thread and wait until it no longer writes into our region."""
    conn.closed = True
    with contextlib.suppress(OSError):
        conn.sock.shutdown(socket.SHUT_RDWR)
    with conn.recv_lock:
        pass


def _refuse(conn: Inbound, transfer_id: int, why: str, count: Callable[[Received], None]) -> None:
    log.warning("tcp: refused transfer %d from %r: %s", transfer_id, conn.peer_id, why)
    count(Received(0, refused=True))
    with contextlib.suppress(OSError):
        conn.sock.sendall(ACK.pack(transfer_id, REFUSED))
