"""Held blocks: kvpeer's own copy of recently stored blocks, served without the engine.

A peer's lookup normally waits for the engine's serve window: only there may the
tier ask the parent what it has and pin it (docs/design.md §4.3). With ``held_bytes`` >
0 the tier also copies every block the engine stores into a region of its own
(:class:`HeldBlocks`), bounded by ``held_bytes``, least recently used released
first, and of the blocks stored or served together the last first: a prompt
loses its tail before its head, so what is left of it is still a prefix a peer
can pull. A lookup or fetch whose keys are all held is answered at once on the
driver thread from those copies (``kvpeer.session.producer`` invariant 9); any
other goes the serve-window way, and a lookup the busy engine is not waited for
is answered with its held prefix (invariant 10). The copy costs one memcpy per
stored block (about 9.5 GB/s here) and, unlike store jobs kept open to keep the
primary's slots pinned, leaves the engine nothing to wait for: vLLM steps without
pause while a tier has a job open, and would never idle.

A held slot is ``num_blocks + row``: past the primary's rows, so a data plane
tells the two apart by the index alone (only ``shm`` reads held rows; sessions on
other planes are never given one).

Invariants (why a peer never receives memory the engine reused):

1. A row is written only by :meth:`HeldBlocks.keep`, and only while its pin
   count is 0: a free row, or the least recently used unpinned one. A key
   already held is not copied again (a key names its block's contents).
2. ``keep`` copies a primary slot only while the engine's store job naming it is
   unreported (the tier calls it in ``submit_store``, before any result of that
   job can exist), and the host may not reuse the slot of an unreported store
   job (vLLM: the job holds the chunk's ref_cnt until ``get_finished_jobs``
   returns it). So a row holds exactly the block of its key.
3. A row is pinned from the moment a peer's lookup or fetch was answered from
   it until the write that reads it finished (or was abandoned, its round
   failed: the consumer discards that slot), or until the supply expired
   unfetched (``store_timeout_s``) or the session ended. Pins are counted per
   row; a row never goes below 0.
4. Held bytes never exceed ``held_bytes`` (rows are allocated once); when every
   row is pinned a new block is simply not kept. A peer can pin at most every
   row, for at most ``store_timeout_s``: it can make us keep fewer blocks for a
   while, never more memory.
5. After :meth:`close` nothing is held or pinnable and the memory is released.

Every method runs under the node's lock.
"""

from __future__ import annotations

import ctypes
import mmap
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpeer.types import Key

__all__ = ["HeldBlocks", "HeldStatistics"]


@dataclass(frozen=True, slots=True)
class HeldStatistics:
    capacity_bytes: int
    blocks: int  # held now
    bytes: int  # held now
    pinned_blocks: int  # held rows a peer's supply pins now
    kept: int  # since start: blocks copied in
    released: int  # since start: blocks released to make room (least recent first)
    skipped: int  # since start: blocks not kept because every row was pinned
    served: int  # since start: pins handed to peers' supply


class HeldBlocks:
    """A bounded, LRU copy of stored blocks (implements ``HeldSupply``)."""

    def __init__(
        self,
        primary: memoryview,
        num_blocks: int,
        block_len: int,
        held_bytes: int,
        *,
        serves: Callable[[str], bool],
    ) -> None:
        """``primary``: the engine's region as flat bytes (``num_blocks`` rows of
        ``block_len``). ``serves(peer_id)``: the data plane toward that peer can
        read held rows."""
        if primary.nbytes != num_blocks * block_len:
            raise ValueError(f"primary of {primary.nbytes} bytes, need {num_blocks} x {block_len}")
        self._cast = primary.format != "B"  # a view of ours, released at close
        self._primary = primary.cast("B") if self._cast else primary
        self._num_blocks = num_blocks
        self._block_len = block_len
        self._rows = held_bytes // block_len
        self._serves = serves
        size = max(1, self._rows) * block_len
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        flags |= getattr(mmap, "MAP_POPULATE", 0)  # fault pages in now, not on first copy
        self._memory: mmap.mmap | None = mmap.mmap(-1, size, flags=flags)
        self.view = memoryview(self._memory)
        self._lru: OrderedDict[Key, int] = OrderedDict()  # key -> row, oldest first
        self._key_of: list[Key | None] = [None] * self._rows
        self._pins = [0] * self._rows
        self._free = list(range(self._rows - 1, -1, -1))
        self._pinned = 0
        self._kept = self._released = self._skipped = self._served = 0

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def base_addr(self) -> int:
        """Address of row 0 (what a data plane copies held rows from)."""
        if self._memory is None:
            raise ValueError("held blocks are closed")
        anchor = ctypes.c_char.from_buffer(self._memory)
        address = ctypes.addressof(anchor)
        del anchor  # the export ends here: close() can unmap
        return address

    @property
    def first_slot(self) -> int:
        """The slot of row 0 (the primary's ``num_blocks``)."""
        return self._num_blocks

    def holds(self, key: Key) -> bool:
        return key in self._lru

    def keep(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """Copy the blocks of ``keys`` from their primary ``slots`` (pinned by the
        caller's unreported store job: invariant 2)."""
        bl = self._block_len
        for key, slot in zip(keys, slots, strict=True):
            if self._memory is None:
                return
            if key in self._lru:
                continue  # made recent below
            if not 0 <= slot < self._num_blocks:
                continue  # not a primary slot: nothing we could copy safely
            row = self._take_row()
            if row is None:
                self._skipped += 1
                continue
            self.view[row * bl : (row + 1) * bl] = self._primary[slot * bl : (slot + 1) * bl]
            self._lru[key] = row
            self._key_of[row] = key
            self._kept += 1
        self._touch(keys)

    def _touch(self, keys: Sequence[Key]) -> None:
        """Make ``keys`` the most recently used, the first of them the most: blocks
        stored or served together are a prompt's, in order, and its head is what a
        later pull needs first (a tail without its head serves nobody)."""
        lru = self._lru
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)

    def _take_row(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, row in self._lru.items():  # oldest first; pinned rows are skipped
            if self._pins[row] == 0:
                del self._lru[key]
                self._key_of[row] = None
                self._released += 1
                return row
        return None

    # -- HeldSupply ----------------------------------------------------------------------

    def pin(self, peer_id: str, keys: Sequence[Key]) -> list[int] | None:
        if self._memory is None or not keys or not self._serves(peer_id):
            return None
        rows = []
        for key in keys:
            row = self._lru.get(key)
            if row is None:
                return None
            rows.append(row)
        for row in rows:
            if self._pins[row] == 0:
                self._pinned += 1
            self._pins[row] += 1
        self._touch(keys)
        self._served += len(rows)
        return [self._num_blocks + row for row in rows]

    def held_prefix(self, peer_id: str, keys: Sequence[Key]) -> int:
        if self._memory is None or not self._serves(peer_id):
            return 0
        count = 0
        for key in keys:
            if key not in self._lru:
                break
            count += 1
        return count

    def unpin(self, slots: Sequence[int]) -> None:
        if self._memory is None:
            return  # closed: every pin went with it
        for slot in slots:
            row = slot - self._num_blocks
            if not 0 <= row < self._rows or self._pins[row] == 0:
                raise ValueError(f"held slot {slot} is not pinned")
            self._pins[row] -= 1
            if self._pins[row] == 0:
                self._pinned -= 1

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Forget every block and release the memory (after the data planes closed:
        nothing reads a row any more)."""
        if self._memory is None:
            return
        self._lru.clear()
        self._pins = [0] * self._rows
        self._pinned = 0
        self.view.release()
        if self._cast:
            self._primary.release()
        self._memory.close()
        self._memory = None

    def statistics(self) -> HeldStatistics:
        return HeldStatistics(
            capacity_bytes=self._rows * self._block_len,
            blocks=len(self._lru),
            bytes=len(self._lru) * self._block_len,
            pinned_blocks=self._pinned,
            kept=self._kept,
            released=self._released,
            skipped=self._skipped,
            served=self._served,
        )
