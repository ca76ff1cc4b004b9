"""The host's primary region: ``num_blocks`` rows of ``block_len`` bytes, and who holds them.

A :class:`BlockPool` is what vLLM's CPU primary tier is to its tiering manager: a
page-aligned, prefaulted host-memory region (``mmap``) whose rows are *slots*, a
key -> slot map, per-slot states and pin counts, and LRU eviction.

Invariants:

1. A slot is FREE (no key), WRITING (key mapped, bytes still arriving) or READY (key
   mapped, bytes readable). Only :meth:`BlockPool.allocate` leaves FREE (to WRITING) and
   only :meth:`BlockPool.complete_write` leaves WRITING (to READY, or back to FREE and
   the key forgotten when the write failed).
2. A key maps to at most one slot and a mapped slot to exactly one key.
3. Only READY slots are pinned; a pinned slot is never evicted, reused or rewritten.
   Pin counts never go below zero: an unbalanced :meth:`BlockPool.unpin` raises.
4. :meth:`BlockPool.allocate` takes the lowest FREE slot (never a withheld one),
   otherwise evicts the least recently used unpinned READY slot; WRITING and pinned
   slots are never taken. A READY slot becomes most recently used when written and on
   every :meth:`BlockPool.lookup` HIT.
5. :meth:`BlockPool.write` only fills WRITING slots and :meth:`BlockPool.read` only
   reads READY ones. Data planes may instead copy through :attr:`BlockPool.view` /
   :meth:`BlockPool.slot_view` under the same rule.

Bad arguments (slot out of range, wrong data length) raise ``ValueError``; calls that
break the state rules above raise ``RuntimeError``. Both name the offending value.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import logging
import mmap
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from kvpeer.host.claims import Claim
from kvpeer.types import Key, LookupResult

__all__ = ["BlockPool", "PoolStatistics", "SlotState"]

log = logging.getLogger("kvpeer.host")

#: Prefault granularity: one written byte per page maps the whole region up front.
_PAGE_SIZE = mmap.PAGESIZE

# Members the hot paths compare against, bound once: ``Enum.MEMBER`` goes through
# EnumType.__getattr__ on Python 3.11 (~0.2 us an access, millions per simulated world).
_HIT: Final = LookupResult.HIT
_HIT_PENDING: Final = LookupResult.HIT_PENDING
_MISS: Final = LookupResult.MISS


class SlotState(enum.Enum):
    """Lifecycle of one row of the primary region."""

    FREE = "free"
    WRITING = "writing"  # key mapped; lookups answer HIT_PENDING; not evictable
    READY = "ready"  # key mapped and readable; evictable when unpinned


_FREE: Final = SlotState.FREE
_WRITING: Final = SlotState.WRITING
_READY: Final = SlotState.READY


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """Snapshot of a :class:`BlockPool`; ``free + writing + ready + withheld ==
    num_blocks``."""

    num_blocks: int
    block_len: int
    free: int
    writing: int
    ready: int
    pinned: int  # READY slots with a pin count above zero
    evictions: int  # READY slots reclaimed by allocate() since creation
    withheld: int = 0  # slots given away for good (:meth:`BlockPool.withhold`)


class BlockPool:
    """Host-memory primary region with slot states, pins and LRU eviction."""

    def __init__(self, num_blocks: int, block_len: int, *, shm_path: str | None = None) -> None:
        """``shm_path``: back the region with that new file (under /dev/shm) so other
        processes on this host (the ``shm`` data plane) can map it; removed at close."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if isinstance(block_len, bool) or not isinstance(block_len, int) or block_len < 1:
            raise ValueError(f"block_len must be a positive int, got {block_len!r}")
        self._num_blocks = num_blocks
        self._block_len = block_len
        size = num_blocks * block_len
        self._shm_path = shm_path
        self._claim: Claim | None = None
        if shm_path is None:
            self._region = mmap.mmap(-1, size)  # anonymous: page-aligned
        else:
            # Claimed first (kvpeer.host.claims): if this process dies without close(),
            # the next node started here removes the file.
            self._claim = Claim(shm_path)
            try:
                fd = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except OSError:
                self._claim.release()
                raise
            try:
                os.ftruncate(fd, size)
                self._region = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self._view = memoryview(self._region)
        # Prefault: a first write into fresh pages runs at a fraction of memcpy speed.
        self._view[::_PAGE_SIZE] = bytes(len(range(0, len(self._view), _PAGE_SIZE)))
        self._states = [_FREE] * num_blocks
        self._keys: list[Key | None] = [None] * num_blocks
        self._pins = [0] * num_blocks
        self._slots: dict[Key, int] = {}
        self._free = list(range(num_blocks))  # a heap: lowest free slot first
        self._recency: OrderedDict[int, None] = OrderedDict()  # READY slots, LRU first
        self._writing = 0
        self._pinned = 0
        self._evictions = 0
        self._withheld: list[int] = []

    # -- geometry ----------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    @property
    def view(self) -> memoryview:
        """The whole region (``num_blocks * block_len`` bytes); slot ``s`` is row ``s``."""
        return self._view

    def slot_view(self, slot: int) -> memoryview:
        """The row of ``slot`` (a view, not a copy)."""
        start = self._check_slot(slot) * self._block_len
        return self._view[start : start + self._block_len]

    # -- keys and states ---------------------------------------------------------

    def lookup(self, key: Key) -> LookupResult:
        """HIT (READY; marks it most recently used), HIT_PENDING (WRITING) or MISS."""
        slot = self._slots.get(key)
        if slot is None:
            return _MISS
        if self._states[slot] is _WRITING:
            return _HIT_PENDING
        self._recency.move_to_end(slot)
        return _HIT

    def slot_of(self, key: Key) -> int | None:
        """The slot mapped to ``key`` (WRITING or READY), or None; does not touch LRU."""
        return self._slots.get(key)

    def key_of(self, slot: int) -> Key | None:
        """The key mapped to ``slot``, or None when it is FREE."""
        return self._keys[self._check_slot(slot)]

    def state(self, slot: int) -> SlotState:
        return self._states[self._check_slot(slot)]

    def pin_count(self, slot: int) -> int:
        return self._pins[self._check_slot(slot)]

    # -- lifecycle ---------------------------------------------------------------

    def allocate(self, key: Key) -> int | None:
        """Map ``key`` to a slot in WRITING state; None if every slot is pinned or WRITING.

        ``key`` must not be mapped already (look it up first).
        """
        if key in self._slots:
            raise RuntimeError(f"key {key.hex()} is already in slot {self._slots[key]}")
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            victim = next((s for s in self._recency if self._pins[s] == 0), None)
            if victim is None:
                return None
            self._forget(victim)
            self._evictions += 1
            slot = victim
        self._states[slot] = _WRITING
        self._writing += 1
        self._keys[slot] = key
        self._slots[key] = slot
        return slot

    def withhold(self, count: int) -> list[int]:
        """Take ``count`` FREE slots out of the pool for good (a tier's staging rows,
        kvpeer.node.ahead): the highest free ones, never allocated, evicted or read by
        the pool again. Raises ``ValueError`` naming the counts if fewer are free."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if count > len(self._free):
            raise ValueError(f"cannot withhold {count} slots: {len(self._free)} are free")
        taken = sorted(self._free)[len(self._free) - count :]
        remaining = set(taken)
        self._free = [slot for slot in self._free if slot not in remaining]
        heapq.heapify(self._free)
        self._withheld.extend(taken)
        return taken

    @property
    def withheld(self) -> frozenset[int]:
        """Slots :meth:`withhold` took out of the pool."""
        return frozenset(self._withheld)

    def complete_write(self, slot: int, success: bool) -> None:
        """End the write into ``slot``: READY, or FREE with its key forgotten on failure."""
        self._require(slot, _WRITING, "complete a write of")
        if success:
            self._states[slot] = _READY
            self._recency[slot] = None
        else:
            self._forget(slot)
            heapq.heappush(self._free, slot)
        self._writing -= 1

    def pin(self, slots: Iterable[int]) -> None:
        """Add one pin to each of ``slots`` (all READY); a slot listed twice gets two."""
        slots = list(slots)
        for slot in slots:
            self._require(slot, _READY, "pin")
        for slot in slots:
            if self._pins[slot] == 0:
                self._pinned += 1
            self._pins[slot] += 1

    def unpin(self, slots: Iterable[int]) -> None:
        """Remove one pin from each of ``slots``; raises (changing nothing) if one is unpinned."""
        slots = list(slots)
        needed: dict[int, int] = {}
        for slot in map(self._check_slot, slots):
            needed[slot] = needed.get(slot, 0) + 1
        for slot, count in needed.items():
            if self._pins[slot] < count:
                raise RuntimeError(
                    f"unpin of slot {slot} {count} time(s) but its pin count is {self._pins[slot]}"
                )
        for slot in slots:
            self._pins[slot] -= 1
            if self._pins[slot] == 0:
                self._pinned -= 1

    # -- bytes -------------------------------------------------------------------

    def write(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        """Copy one block into a WRITING slot."""
        self._require(slot, _WRITING, "write into")
        if len(data) != self._block_len:
            raise ValueError(
                f"slot {slot}: data is {len(data)} bytes, a block is {self._block_len}"
            )
        start = slot * self._block_len
        self._view[start : start + self._block_len] = data

    def read(self, slot: int) -> bytes:
        """A copy of a READY slot's block."""
        self._require(slot, _READY, "read")
        start = slot * self._block_len
        return bytes(self._view[start : start + self._block_len])

    # -- observability -----------------------------------------------------------

    @property
    def pinned(self) -> int:
        """Slots holding at least one pin: :meth:`statistics`' count, for a caller
        that asks every step and wants nothing else."""
        return self._pinned

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            num_blocks=self._num_blocks,
            block_len=self._block_len,
            free=len(self._free),
            writing=self._writing,
            ready=len(self._recency),
            pinned=self._pinned,
            evictions=self._evictions,
            withheld=len(self._withheld),
        )

    @property
    def shm_path(self) -> str | None:
        """The file backing the region, if any (other local processes may map it)."""
        return self._shm_path

    def close(self) -> None:
        """Unmap the region and remove its file. Views handed out must be released;
        if one still is (a data plane that did not stop), the file is removed all
        the same and the mapping goes with the process (logged)."""
        try:
            self._view.release()
            self._region.close()
        except BufferError as exc:
            log.warning("primary region still in use at close (%s); left mapped", exc)
        finally:
            if self._shm_path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._shm_path)
                self._shm_path = None
            if self._claim is not None:
                self._claim.release()
                self._claim = None

    # -- internals ---------------------------------------------------------------

    def _check_slot(self, slot: int) -> int:
        """``slot`` as an index; a plain int (every call but a caller's mistake) is
        told apart by its type alone, before the isinstance tests (a bool is an int)."""
        if type(slot) is not int and (isinstance(slot, bool) or not isinstance(slot, int)):
            raise ValueError(f"slot must be an int, got {slot!r}")
        if not 0 <= slot < self._num_blocks:
            raise ValueError(f"slot {slot} out of range [0, {self._num_blocks})")
        return slot

    def _require(self, slot: int, state: SlotState, action: str) -> None:
        actual = self._states[self._check_slot(slot)]
        if actual is not state:
            raise RuntimeError(
                f"cannot {action} slot {slot}: it is {actual.value}, not {state.value}"
            )

    def _forget(self, slot: int) -> None:
        """Unmap an unpinned slot's key and leave it FREE (not on the free heap)."""
        key = self._keys[slot]
        assert key is not None, f"slot {slot} has no key"
        assert self._pins[slot] == 0, f"slot {slot} is pinned"
        del self._slots[key]
        self._keys[slot] = None
        self._recency.pop(slot, None)
        self._states[slot] = _FREE
