"""The ``shm`` data plane: same-host writes straight into the peer's shared region.

The consumer's primary region is a file under ``/dev/shm``; its offer names the file,
the host and the file's identity. A producer on the same host maps that file once at
``add_peer`` (shared, read-write) and copies blocks into it with plain memory copies.
The mapping is prefaulted by the copy thread afterwards, so the handshake never waits
for it. The consumer takes no part in a write, so windows are not enforced
(``accept_writer`` has nothing to do): a one-sided write cannot be refused.

Invariants:

1. A transfer of at most :data:`INLINE_BYTES` that finds nothing queued is copied
   on the caller's thread (cheaper than a hop to another thread and back); every
   other one is queued for the backend's copy thread, which runs them in order.
2. Slots are checked against both regions before a transfer is queued; the copy
   thread copies raw addresses, so nothing unchecked ever reaches it.
3. A peer's mapping is unmapped only when no copy uses it: ``remove_peer`` and
   ``close`` drop queued transfers, stop the running one at its next chunk and wait
   for it before unmapping.
4. Every transfer is reported at most once, through ``poll`` of its peer; a cancelled
   (released or abandoned) transfer is never reported.
5. Contiguous runs (consecutive local *and* remote slots) are copied as one range, in
   chunks of at most :data:`CHUNK_BYTES` so a cancel or removal waits for one chunk.
6. A new mapping's pages are faulted in by the copy thread, :data:`PREFAULT_BYTES`
   at a time without the GIL, only while no transfer is queued: ``add_peer`` (on the
   handshake's path) returns at once, and a transfer never waits for more than one
   piece. A copy into a page not faulted in yet is correct, only slower.

The region must outlive the backend: close the backend before unmapping the region.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import hashlib
import itertools
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpeer.errors import DataPlaneError
from kvpeer.protocol import Connect, TransportOffer
from kvpeer.session.ports import TransferEvent
from kvpeer.transport.data.base import PrimaryRegion, WriteWindow

__all__ = ["CHUNK_BYTES", "ShmBackend", "ShmStatistics", "host_identity"]

#: Largest single copy: bounds how long a cancel or ``remove_peer`` waits for the thread.
CHUNK_BYTES = 16 * 1024 * 1024
#: Transfers up to this size are copied on the calling thread: 1 MiB takes ~0.1 ms
#: here, less than handing it to the copy thread and being told back (~0.15 ms).
INLINE_BYTES = 1024 * 1024
#: The copy thread faults a new mapping in by pieces of this size (invariant 6).
PREFAULT_BYTES = 4 * 1024 * 1024
#: ``MADV_POPULATE_WRITE`` (Linux 5.14+); the ``mmap`` module exports it only from 3.13.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_JOIN_TIMEOUT_S = 10.0


def host_identity() -> str:
    """This boot of this machine: hash of ``/etc/machine-id`` and the kernel boot id."""
    digest = hashlib.sha256()
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        with contextlib.suppress(OSError), open(path, "rb") as source:
            digest.update(source.read().strip())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class ShmStatistics:
    peers: int
    queued: int  # transfers waiting for the copy thread
    completed: int
    cancelled: int  # released before they started or abandoned
    bytes_copied: int


class _State(enum.Enum):
    QUEUED = "queued"
    COPYING = "copying"
    DONE = "done"  # copied; the event waits for poll


@dataclass(slots=True)
class _Mapping:
    """A peer's region mapped into our address space."""

    mm: mmap.mmap
    base: int  # address of its row 0
    num_blocks: int
    size: int = 0
    users: int = 0  # transfers (or a prefault piece) using it right now
    prefaulted: int = 0  # bytes from the start already faulted in
    removed: bool = False


@dataclass(slots=True)
class _Transfer:
    transfer_id: int
    peer_id: str
    mapping: _Mapping
    runs: list[tuple[int, int, int]]  # (local slot, remote slot, blocks)
    state: _State = _State.QUEUED
    abandoned: bool = False


@dataclass(slots=True)
class _Counters:
    completed: int = 0
    cancelled: int = 0
    bytes_copied: int = 0
    events: dict[str, list[TransferEvent]] = field(default_factory=dict)


def _runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce pairs into runs of consecutive local and remote slots."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(local, remote, strict=True):
        if runs:
            first_src, first_dst, count = runs[-1]
            if src == first_src + count and dst == first_dst + count:
                runs[-1] = (first_src, first_dst, count + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def _check_slots(slots: Sequence[int], limit: int, whose: str) -> None:
    for slot in slots:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < limit:
            raise DataPlaneError(f"{whose} slot {slot!r} outside 0..{limit - 1}")


class ShmBackend:
    """Implements :class:`~kvpeer.transport.data.base.Backend` over shared files."""

    def __init__(self, region: PrimaryRegion, notify: Callable[[], None]) -> None:
        if region.shm_path is None:
            raise DataPlaneError(
                "the shm data plane needs a primary region backed by a shared-memory file "
                "(e.g. BlockPool(..., shm_path='/dev/shm/...')); this region has none"
            )
        self._region = region
        self._path = region.shm_path
        self._notify = notify
        self._host_id = host_identity()
        self._size = region.num_blocks * region.block_len
        self._base = region.base_addr
        stat = os.stat(self._path)
        self._file_id = (stat.st_dev, stat.st_ino)
        self._ids = itertools.count(1)
        mutex = threading.Lock()
        # Two conditions on one lock: the copy thread sleeps on _lock (work queued),
        # remove_peer on _idle (a mapping's users dropped). A finished transfer then
        # wakes nobody who has nothing to do.
        self._lock = threading.Condition(mutex)
        self._idle = threading.Condition(mutex)
        self._queue: deque[_Transfer] = deque()
        self._unfaulted: deque[_Mapping] = deque()  # mappings to prefault (invariant 6)
        self._transfers: dict[int, _Transfer] = {}
        self._peers: dict[str, _Mapping] = {}
        self._counters = _Counters()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvpeer-shm-copy", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return "shm"

    # -- negotiation ---------------------------------------------------------------------

    def offer(self) -> TransportOffer:
        return {
            "path": self._path,
            "host_id": self._host_id,
            "size": self._size,
            "device": self._file_id[0],
            "inode": self._file_id[1],
        }

    def agent_metadata(self) -> bytes:
        return b""

    def usable_with(self, offer: TransportOffer | None, hello: Connect) -> bool:
        if offer is None or offer.get("host_id") != self._host_id:
            return False
        path = offer.get("path")
        if not isinstance(path, str) or not path:
            return False
        try:
            stat = os.stat(path)
        except OSError:
            return False
        size = hello.num_blocks * hello.block_len
        if offer.get("size") != size or stat.st_size != size:
            return False
        # The file must be the one the peer created, not a namesake in another mount.
        return (
            offer.get("device", stat.st_dev) == stat.st_dev
            and offer.get("inode", stat.st_ino) == stat.st_ino
        )

    def add_peer(
        self, peer_id: str, hello: Connect, offer: TransportOffer | None
    ) -> TransportOffer:
        if offer is None or not self.usable_with(offer, hello):
            raise DataPlaneError(f"shm: cannot map the region of {peer_id!r} (offer {offer!r})")
        self.remove_peer(peer_id)
        path = offer["path"]
        assert isinstance(path, str)
        size = hello.num_blocks * hello.block_len
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                # The file we opened must be the one we checked: a copy past its end
                # would raise SIGBUS and take the whole process down.
                stat = os.fstat(fd)
                if stat.st_size != size or offer.get("inode", stat.st_ino) != stat.st_ino:
                    raise OSError(f"{path} changed after it was checked")
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            raise DataPlaneError(f"shm: cannot map {path} of {peer_id!r}: {exc}") from exc
        anchor = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(anchor)
        del anchor  # the export would keep the mapping from ever closing
        with self._lock:
            if self._closed:
                mm.close()
                raise DataPlaneError("shm: backend is closed")
            mapping = _Mapping(mm, base, hello.num_blocks, size)
            self._peers[peer_id] = mapping
            self._unfaulted.append(mapping)
            self._lock.notify_all()
        return {}

    def accept_writer(self, peer_id: str, params: TransportOffer, window: WriteWindow) -> None:
        """Nothing to do: the peer writes into our file without us."""

    def grant(self, peer_id: str) -> None:
        """Nothing to do yet."""

    def revoke(self, peer_id: str) -> None:
        """Nothing to do yet."""

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            mapping = self._peers.pop(peer_id, None)
            for transfer in [t for t in self._transfers.values() if t.peer_id == peer_id]:
                self._drop(transfer)
            self._counters.events.pop(peer_id, None)
            if mapping is None:
                return
            mapping.removed = True
            with contextlib.suppress(ValueError):
                self._unfaulted.remove(mapping)
            if not self._idle.wait_for(lambda: mapping.users == 0, timeout=_JOIN_TIMEOUT_S):
                raise DataPlaneError(f"shm: copy into {peer_id!r} did not stop; mapping kept")
        mapping.mm.close()

    # -- transfers -----------------------------------------------------------------------

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        if len(local_slots) != len(remote_slots):
            raise DataPlaneError(
                f"shm: {len(local_slots)} local slots but {len(remote_slots)} remote slots"
            )
        with self._lock:
            if self._closed:
                raise DataPlaneError("shm: backend is closed")
            mapping = self._peers.get(peer_id)
            if mapping is None:
                raise DataPlaneError(f"shm: peer {peer_id!r} is not registered")
            _check_slots(local_slots, self._region.num_blocks, "local")
            _check_slots(remote_slots, mapping.num_blocks, f"remote ({peer_id!r})")
            transfer = _Transfer(
                next(self._ids), peer_id, mapping, _runs(local_slots, remote_slots)
            )
            self._transfers[transfer.transfer_id] = transfer
            inline = not self._queue and len(local_slots) * self._region.block_len <= INLINE_BYTES
            if inline:
                transfer.state = _State.COPYING
                mapping.users += 1
            else:
                self._queue.append(transfer)
                self._lock.notify_all()
        if inline:
            # A small copy costs less than waking the copy thread and being woken back:
            # do it here, so the caller's next poll already sees it finished.
            self._finish(transfer, self._copy(transfer), notify=False)
        return transfer.transfer_id

    def poll(self, peer_id: str) -> list[TransferEvent]:
        with self._lock:
            events = self._counters.events.pop(peer_id, [])
            for event in events:
                del self._transfers[event.transfer_id]
        return events

    def cancel(self, transfer_ids: Sequence[int], *, wait: bool) -> list[int]:
        busy: list[int] = []
        with self._lock:
            for transfer_id in transfer_ids:
                transfer = self._transfers.get(transfer_id)
                if transfer is None:
                    continue
                if wait and transfer.state is _State.COPYING:
                    busy.append(transfer_id)
                else:
                    self._drop(transfer)
        return busy

    def statistics(self) -> ShmStatistics:
        with self._lock:
            return ShmStatistics(
                peers=len(self._peers),
                queued=len(self._queue),
                completed=self._counters.completed,
                cancelled=self._counters.cancelled,
                bytes_copied=self._counters.bytes_copied,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for transfer in list(self._transfers.values()):
                self._drop(transfer)
            self._lock.notify_all()
            self._idle.notify_all()
        if self._thread is not threading.current_thread():  # notify may close us
            self._thread.join(_JOIN_TIMEOUT_S)
        with self._lock:
            mappings = list(self._peers.values()) if not self._thread.is_alive() else []
            self._peers.clear()
        for mapping in mappings:
            mapping.mm.close()

    # -- internals -----------------------------------------------------------------------

    def _drop(self, transfer: _Transfer) -> None:
        """Release or abandon ``transfer`` (lock held); it is never reported."""
        del self._transfers[transfer.transfer_id]
        self._counters.cancelled += 1
        if transfer.state is _State.QUEUED:
            self._queue.remove(transfer)
        elif transfer.state is _State.COPYING:
            transfer.abandoned = True  # the thread stops at its next chunk
        else:
            events = self._counters.events.get(transfer.peer_id, [])
            events[:] = [e for e in events if e.transfer_id != transfer.transfer_id]

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._unfaulted or self._closed)
                if self._closed:
                    return
                if not self._queue:
                    self._prefault_piece()
                    continue
                transfer = self._queue.popleft()
                transfer.state = _State.COPYING
                transfer.mapping.users += 1
            self._finish(transfer, self._copy(transfer), notify=True)

    def _prefault_piece(self) -> None:
        """Fault in the next piece of the oldest unfaulted mapping (lock held on entry
        and exit; released while the pages are faulted in)."""
        mapping = self._unfaulted[0]
        start = mapping.prefaulted
        length = min(PREFAULT_BYTES, mapping.size - start)
        mapping.users += 1
        self._lock.release()
        try:
            _prefault(mapping.mm, mapping.base, start, length)
        finally:
            self._lock.acquire()
            mapping.users -= 1
            mapping.prefaulted = start + length
            if (mapping.prefaulted >= mapping.size or mapping.removed) and (
                self._unfaulted and self._unfaulted[0] is mapping
            ):
                self._unfaulted.popleft()
            self._idle.notify_all()

    def _finish(self, transfer: _Transfer, copied: int, *, notify: bool) -> None:
        with self._lock:
            transfer.mapping.users -= 1
            self._counters.bytes_copied += copied
            finished = not transfer.abandoned
            if finished:
                transfer.state = _State.DONE
                self._counters.completed += 1
                self._counters.events.setdefault(transfer.peer_id, []).append(
                    TransferEvent(transfer.transfer_id, True)
                )
            self._idle.notify_all()
        if finished and notify:
            self._notify()

    def _copy(self, transfer: _Transfer) -> int:
        """Copy every run (the GIL is released by ``memmove``); stop early if abandoned."""
        block_len = self._region.block_len
        step = max(1, CHUNK_BYTES // block_len)
        copied = 0
        for src, dst, count in transfer.runs:
            for offset in range(0, count, step):
                if transfer.abandoned:
                    return copied
                size = min(step, count - offset) * block_len
                ctypes.memmove(
                    transfer.mapping.base + (dst + offset) * block_len,
                    self._base + (src + offset) * block_len,
                    size,
                )
                copied += size
        return copied


def _prefault(mm: mmap.mmap, base: int, start: int, length: int) -> None:
    """Fault in ``length`` bytes of ``mm`` from ``start`` (page aligned): first touches
    run at a fraction of memcpy speed.

    ``MADV_POPULATE_WRITE`` faults pages in writable without changing them; it is
    called through ctypes, which releases the GIL (``mmap.madvise`` holds it, and
    the engine thread with it). Older kernels get one *read* per page: writing
    would race with the owner's own writes.
    """
    if _LIBC is not None and _LIBC.madvise(base + start, length, _MADV_POPULATE_WRITE) == 0:
        return
    view = memoryview(mm)
    try:
        bytes(view[start : start + length : mmap.PAGESIZE])
    finally:
        view.release()


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return libc


_LIBC = _libc()
