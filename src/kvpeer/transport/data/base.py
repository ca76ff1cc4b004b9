"""Data-plane backends: the contract every plane (memory, shm, tcp, nixl) fulfils.

A backend moves whole blocks from rows of our :class:`PrimaryRegion` into rows of a
peer's region (producer push) and reports completion per peer. Contract:

1. ``offer()`` is what a peer needs to write into us with this backend (sent in our
   ``connect``); ``usable_with(offer, hello)`` says whether we can write into a peer
   that made that offer (e.g. ``shm`` only on the same host).
2. ``add_peer`` prepares writing into the peer (before our ``connect_ack``) and returns
   the parameters the peer needs to accept our writes; ``accept_writer`` is called with
   those parameters on the other side. ``remove_peer`` forgets the peer and abandons its
   transfers.
3. ``write_blocks`` never blocks and returns a backend-unique transfer id, or raises
   :class:`~kvpeer.errors.DataPlaneError`. Indexes are checked against both regions.
4. ``poll(peer_id)`` returns each finished transfer of that peer exactly once.
   ``cancel(ids, wait=True)`` returns the ids that may still touch memory; with
   ``wait=False`` they are abandoned and never reported.
5. Writes from a peer land only in slots the window (:class:`WriteWindow`) has open for
   it; backends in which the consumer takes part (``tcp``) enforce this.
6. ``notify`` (given at construction) is called from any thread when a transfer
   finished, so the node's driver wakes up. The node may poll on the calling
   thread inside ``notify`` (and call back into the backend): call it without
   holding the backend's lock, from a thread that waits for nothing the backend's
   own methods wait for.
7. ``close`` releases everything and is idempotent.
8. ``grant(peer_id)`` is called when the node opens a session toward ``peer_id``,
   before our ``connect`` (with ``offer()``) goes to it, and ``revoke(peer_id)``
   when that session ends. A plane whose offer lets a peer take something of ours
   on proof of who it is (``shm``: our region's descriptor) gives it only to
   granted peer ids. Neither call blocks nor raises.
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpeer.protocol import Connect, TransportOffer
from kvpeer.session.ports import TransferEvent

__all__ = ["Backend", "PrimaryRegion", "WriteWindow"]


@dataclass(frozen=True, slots=True)
class PrimaryRegion:
    """Our primary region: ``num_blocks`` rows of ``block_len`` bytes.

    ``shm_path`` names a file other processes on this host may map (``shm``).
    """

    view: memoryview
    num_blocks: int
    block_len: int
    shm_path: str | None = None

    def __post_init__(self) -> None:
        if self.view.nbytes != self.num_blocks * self.block_len:
            raise ValueError(
                f"region view of {self.view.nbytes} bytes, need "
                f"{self.num_blocks} x {self.block_len}"
            )

    @property
    def base_addr(self) -> int:
        """Address of row 0 (what NIXL registers and vLLM peers expect)."""
        flat = self.view.cast("B") if self.view.format != "B" or self.view.ndim != 1 else self.view
        if flat.readonly:
            raise ValueError("the primary region must be writable")
        return ctypes.addressof(ctypes.c_char.from_buffer(flat))

    def row(self, slot: int) -> memoryview:
        start = slot * self.block_len
        return self.view[start : start + self.block_len]


class WriteWindow:
    """Slots of ours that one peer may currently write (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: Counter[int] = Counter()

    def open(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._open.update(slots)

    def close(self, slots: Sequence[int]) -> None:
        with self._lock:
            for slot in slots:
                count = self._open[slot] - 1
                if count > 0:
                    self._open[slot] = count
                else:
                    del self._open[slot]

    def allows(self, slot: int) -> bool:
        with self._lock:
            return self._open[slot] > 0 if slot in self._open else False

    def snapshot(self) -> set[int]:
        with self._lock:
            return set(self._open)


class Backend(Protocol):
    """One data plane.

    ``registers_slowly``: ``add_peer`` may wait on something outside this process
    (a NIXL metadata load, a peer's descriptor server); the plane set then calls it
    off the node's lock (:mod:`kvpeer.transport.data.planes`). ``add_peer`` must be
    safe beside the node's other calls into the backend either way.
    """

    registers_slowly: bool

    @property
    def name(self) -> str: ...

    def offer(self) -> TransportOffer: ...

    def agent_metadata(self) -> bytes:
        """NIXL agent metadata for ``connect`` (empty for other planes)."""
        ...

    def usable_with(self, offer: TransportOffer | None, hello: Connect) -> bool: ...

    def add_peer(
        self, peer_id: str, hello: Connect, offer: TransportOffer | None
    ) -> TransportOffer: ...

    def accept_writer(self, peer_id: str, params: TransportOffer, window: WriteWindow) -> None: ...

    def remove_peer(self, peer_id: str) -> None:
        """Forget ``peer_id``: :meth:`detach_peer` and its returned work, in order."""
        ...

    def detach_peer(self, peer_id: str) -> Callable[[], None] | None:
        """Forget ``peer_id`` at once (its transfers abandoned, no new ones, no events)
        and return the slow rest of the removal (unmapping, unloading NIXL state) for
        the caller to run later, off its lock; None when nothing is left to do."""
        ...

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int: ...

    def poll(self, peer_id: str) -> list[TransferEvent]: ...

    def cancel(self, transfer_ids: Sequence[int], *, wait: bool) -> list[int]: ...

    def close(self) -> None: ...

    def grant(self, peer_id: str) -> None: ...

    def revoke(self, peer_id: str) -> None: ...
