"""The ``shm`` data plane: same-host writes straight into the peer's shared region.

The consumer's primary region is a shared-memory file. Its offer is
``{"socket": <32 hex>, "size": <region bytes>, "host_id": <this boot of this host>}``:
no path, device or inode. ``host_id`` only saves a connection attempt between
hosts that are obviously different; it proves nothing (a peer can echo ours).

The proof is :mod:`~kvpeer.transport.data.shmgrant`: each backend opens its *own*
region file once, at construction, and serves that descriptor on an abstract Unix
socket named by the hex. A producer on the same host connects to it at ``add_peer``,
names itself (``local_id``) and the peer it registers, and receives the descriptor
with ``SCM_RIGHTS`` from a process whose pid and uid the kernel reports
(``SO_PEERCRED``); the owner sends it only to producers it has *granted* (``grant``
when the node opens a session toward that peer id, ``revoke`` when it ends). The
producer maps the descriptor once (shared, read-write) and copies blocks into it with
plain memory copies; the copy thread prefaults the mapping afterwards, so the
handshake never waits for it. The consumer takes no part in a write, so windows are
not enforced (``accept_writer`` has nothing to do): a one-sided write cannot be
refused. A failed proof is a :class:`~kvpeer.errors.DataPlaneError` from ``add_peer``
and the plane set tries its next plane.

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
7. No path a peer names is ever opened, and no socket but ``"\\0kvpeer-shm-" + hex``
   of 32 validated hex characters is dialled. A mapped descriptor is a regular file
   of exactly the peer's advertised size, opened read-write, that is not our own
   region (same device and inode), received from a process of an allowed uid that
   is not this one (unless ``same_process``).
8. What a peer sends ends in ``False`` from ``usable_with`` or a ``DataPlaneError``
   from ``add_peer``, never another exception; our own faults (backend closed, our
   region unusable) are :class:`~kvpeer.errors.LocalFault`.

Residual risk: an owner that shrinks its own file under a producer's mapping makes the
producer's next copy fault (``SIGBUS``); only a local process of an allowed uid can.
The region must outlive the backend: close the backend before unmapping the region.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpeer.errors import DataPlaneError, LocalFault
from kvpeer.protocol import Connect, TransportOffer
from kvpeer.session.ports import TransferEvent
from kvpeer.transport.data.base import PrimaryRegion, WriteWindow
from kvpeer.transport.data.shmgrant import (
    CredentialPolicy,
    GrantServer,
    is_socket_name,
    request_region,
)

__all__ = ["CHUNK_BYTES", "REQUEST_TIMEOUT_S", "ShmBackend", "ShmStatistics", "host_identity"]

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
#: How long ``add_peer`` waits, in total, for a peer's region descriptor.
REQUEST_TIMEOUT_S = 1.0

log = logging.getLogger("kvpeer.shm")


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
    granted: int  # peer ids that may receive our region's descriptor now
    regions_served: int  # descriptors of our region handed to producers
    requests_refused: int  # producers' requests for it we refused


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


def _runs(
    local: Sequence[int], remote: Sequence[int], split: int | None = None
) -> list[tuple[int, int, int]]:
    """Coalesce pairs into runs of consecutive local and remote slots (no run
    crosses local slot ``split``: the primary's rows end there, held rows begin)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(local, remote, strict=True):
        if runs:
            first_src, first_dst, count = runs[-1]
            if src == first_src + count and dst == first_dst + count and src != split:
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

    registers_slowly = True  # a request to the peer's descriptor server

    def __init__(
        self,
        region: PrimaryRegion,
        notify: Callable[[], None],
        *,
        local_id: str,
        allowed_uids: frozenset[int] | None = None,
        same_process: bool = False,
        held: tuple[int, int] | None = None,
    ) -> None:
        """``local_id``: our node's control identity (its peer id), which we name when we
        ask a peer for its region. ``allowed_uids``: users whose processes may exchange
        regions with us (default: ours only). ``same_process``: also with other nodes
        of this process (tests build several; a node process otherwise runs one)."""
        if region.shm_path is None:
            raise DataPlaneError(
                "the shm data plane needs a primary region backed by a shared-memory file "
                "(e.g. BlockPool(..., shm_path='/dev/shm/...')); this region has none"
            )
        self._region = region
        self._local_id = local_id
        self._notify = notify
        self._host_id = host_identity()
        self._size = region.num_blocks * region.block_len
        self._base = region.base_addr
        # Held rows (kvpeer.node.held): (address of row 0, rows), read as local slots
        # num_blocks.. ; the node keeps them pinned while a transfer reads them.
        self._held_base, self._held_rows = held if held is not None else (0, 0)
        self._policy = CredentialPolicy(
            frozenset({os.getuid()}) if allowed_uids is None else frozenset(allowed_uids),
            same_process,
        )
        # Our own region, opened once: the only path this plane ever opens.
        self._fd = _open_own_region(region.shm_path, self._size)
        try:
            own = os.fstat(self._fd)
            self._file_id = (own.st_dev, own.st_ino)
            self._server = GrantServer(self._fd, local_id=local_id, policy=self._policy)
        except BaseException:
            os.close(self._fd)
            raise
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
        if not self._server.alive:  # nothing answers: let peers pick another plane
            return {"size": self._size, "host_id": self._host_id}
        return {"socket": self._server.name, "size": self._size, "host_id": self._host_id}

    def agent_metadata(self) -> bytes:
        return b""

    def usable_with(self, offer: TransportOffer | None, hello: Connect) -> bool:
        """Whether the offer is well-formed and could be ours to map (no I/O; the
        proof happens in ``add_peer``)."""
        return self._offer_refusal(offer, hello) is None

    def add_peer(
        self, peer_id: str, hello: Connect, offer: TransportOffer | None
    ) -> TransportOffer:
        refusal = self._offer_refusal(offer, hello)
        if refusal is not None:
            raise DataPlaneError(f"shm: cannot use the offer of {peer_id!r}: {refusal}")
        assert offer is not None
        name = offer["socket"]
        assert isinstance(name, str)
        with self._lock:
            if self._closed:
                raise LocalFault("shm: backend is closed")
        self.remove_peer(peer_id)
        size = hello.num_blocks * hello.block_len
        fd = request_region(
            name,
            producer=self._local_id,
            consumer=peer_id,
            policy=self._policy,
            timeout_s=REQUEST_TIMEOUT_S,
        )
        try:
            problem = self._descriptor_refusal(fd, size)
            if problem is not None:
                raise DataPlaneError(f"shm: the region of {peer_id!r} is unusable: {problem}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)  # keeps its own duplicate
        except (OSError, ValueError) as exc:
            raise DataPlaneError(f"shm: cannot map the region of {peer_id!r}: {exc}") from exc
        finally:
            os.close(fd)
        anchor = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(anchor)
        del anchor  # the export would keep the mapping from ever closing
        with self._lock:
            if self._closed:
                mm.close()
                raise LocalFault("shm: backend is closed")
            mapping = _Mapping(mm, base, hello.num_blocks, size)
            self._peers[peer_id] = mapping
            self._unfaulted.append(mapping)
            self._lock.notify_all()
        log.info("shm: mapped the region of %s (%d bytes)", peer_id, size)
        return {}

    def grant(self, peer_id: str) -> None:
        """``peer_id`` may receive our region's descriptor (we open a session with it)."""
        self._server.grant(peer_id)

    def revoke(self, peer_id: str) -> None:
        """``peer_id`` may not anymore (a mapping it already holds stays its own)."""
        self._server.revoke(peer_id)

    def accept_writer(self, peer_id: str, params: TransportOffer, window: WriteWindow) -> None:
        """Nothing to do: the peer writes into our file without us."""

    def remove_peer(self, peer_id: str) -> None:
        unmap = self.detach_peer(peer_id)
        if unmap is not None:
            unmap()

    def detach_peer(self, peer_id: str) -> Callable[[], None] | None:
        """Forget ``peer_id`` now; the returned work waits for a copy into its mapping
        to stop (a removed mapping starts no new one) and unmaps it."""
        with self._lock:
            mapping = self._peers.pop(peer_id, None)
            for transfer in [t for t in self._transfers.values() if t.peer_id == peer_id]:
                self._drop(transfer)
            self._counters.events.pop(peer_id, None)
            if mapping is None:
                return None
            mapping.removed = True
            with contextlib.suppress(ValueError):
                self._unfaulted.remove(mapping)

        def unmap() -> None:
            with self._lock:
                if not self._idle.wait_for(lambda: mapping.users == 0, timeout=_JOIN_TIMEOUT_S):
                    raise DataPlaneError(f"shm: copy into {peer_id!r} did not stop; mapping kept")
            mapping.mm.close()

        return unmap

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
                raise LocalFault("shm: backend is closed")
            mapping = self._peers.get(peer_id)
            if mapping is None:
                raise DataPlaneError(f"shm: peer {peer_id!r} is not registered")
            num_blocks = self._region.num_blocks
            _check_slots(local_slots, num_blocks + self._held_rows, "local")
            _check_slots(remote_slots, mapping.num_blocks, f"remote ({peer_id!r})")
            transfer = _Transfer(
                next(self._ids), peer_id, mapping, _runs(local_slots, remote_slots, num_blocks)
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
        grants = self._server.statistics()
        with self._lock:
            return ShmStatistics(
                peers=len(self._peers),
                queued=len(self._queue),
                completed=self._counters.completed,
                cancelled=self._counters.cancelled,
                bytes_copied=self._counters.bytes_copied,
                granted=grants.granted,
                regions_served=grants.served,
                requests_refused=grants.refused,
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
        self._server.close()  # its thread is stopped: nothing sends our descriptor now
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # -- internals -----------------------------------------------------------------------

    def _offer_refusal(self, offer: TransportOffer | None, hello: Connect) -> str | None:
        """Why ``offer`` cannot be a peer's region on this host, or None."""
        if not isinstance(offer, dict):
            return "no shm offer"
        if offer.get("host_id") != self._host_id:
            return "another host"
        name = offer.get("socket")
        if not is_socket_name(name):
            return "no valid socket name (32 lowercase hex characters)"
        if name == self._server.name:
            return "the offer names our own socket"
        size = offer.get("size")
        expected = hello.num_blocks * hello.block_len
        if isinstance(size, bool) or not isinstance(size, int) or size != expected:
            return f"size {size!r:.40} is not the advertised region's {expected}"
        return None

    def _descriptor_refusal(self, fd: int, size: int) -> str | None:
        """Why a received descriptor must not be mapped, or None (invariant 7)."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return f"not a regular file (mode {info.st_mode:#o})"
        if info.st_size != size:
            return f"{info.st_size} bytes, not {size}"
        if (info.st_dev, info.st_ino) == self._file_id:
            return "it is our own region"
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            return "not open for reading and writing"
        return None

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
        num_blocks = self._region.num_blocks
        for src, dst, count in transfer.runs:
            if src < num_blocks:
                source = self._base + src * block_len
            else:  # a held row (runs never cross num_blocks)
                source = self._held_base + (src - num_blocks) * block_len
            for offset in range(0, count, step):
                if transfer.abandoned:
                    return copied
                size = min(step, count - offset) * block_len
                ctypes.memmove(
                    transfer.mapping.base + (dst + offset) * block_len,
                    source + offset * block_len,
                    size,
                )
                copied += size
        return copied


def _open_own_region(path: str, size: int) -> int:
    """Our region's file, opened once (a path of ours, never a peer's)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise LocalFault(f"shm: cannot open our own region {path}: {exc}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != size:
        os.close(fd)
        raise LocalFault(f"shm: our region {path} is not a {size}-byte regular file")
    return fd


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
