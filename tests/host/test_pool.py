"""BlockPool: slot states, LRU eviction, pins, bytes and errors."""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import uuid

import pytest

from kvpeer.host import BlockPool, PoolStatistics, SlotState
from kvpeer.types import LookupResult

BLOCK = 64


def block(fill: int) -> bytes:
    return bytes([fill]) * BLOCK


def ready(pool: BlockPool, key: bytes, fill: int = 1) -> int:
    """Allocate, write and complete ``key``; return its slot."""
    slot = pool.allocate(key)
    assert slot is not None
    pool.write(slot, block(fill))
    pool.complete_write(slot, True)
    return slot


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(4, BLOCK)


class TestRegion:
    def test_geometry_and_page_alignment(self, pool: BlockPool) -> None:
        assert (pool.num_blocks, pool.block_len) == (4, BLOCK)
        assert len(pool.view) == 4 * BLOCK
        address = ctypes.addressof(ctypes.c_char.from_buffer(pool.view))
        assert address % mmap.PAGESIZE == 0

    def test_slot_view_is_the_row(self, pool: BlockPool) -> None:
        slot = pool.allocate(b"k")
        assert slot is not None
        pool.slot_view(slot)[:] = block(7)
        pool.complete_write(slot, True)
        assert pool.read(slot) == block(7)
        assert bytes(pool.view[slot * BLOCK : (slot + 1) * BLOCK]) == block(7)

    @pytest.mark.parametrize(("num_blocks", "block_len"), [(0, 8), (4, 0), (-1, 8), (True, 8)])
    def test_bad_geometry_is_named(self, num_blocks: int, block_len: int) -> None:
        with pytest.raises(ValueError, match=r"must be a positive int"):
            BlockPool(num_blocks, block_len)

    def test_close(self) -> None:
        pool = BlockPool(2, BLOCK)
        pool.close()
        with pytest.raises(ValueError, match="released"):
            pool.view[0]


class TestStates:
    def test_write_lifecycle(self, pool: BlockPool) -> None:
        assert pool.lookup(b"a") is LookupResult.MISS
        slot = pool.allocate(b"a")
        assert slot == 0
        assert pool.state(slot) is SlotState.WRITING
        assert pool.lookup(b"a") is LookupResult.HIT_PENDING
        pool.write(slot, block(3))
        pool.complete_write(slot, True)
        assert pool.state(slot) is SlotState.READY
        assert pool.lookup(b"a") is LookupResult.HIT
        assert pool.read(slot) == block(3)
        assert (pool.slot_of(b"a"), pool.key_of(slot)) == (slot, b"a")

    def test_failed_write_frees_the_slot_and_forgets_the_key(self, pool: BlockPool) -> None:
        slot = pool.allocate(b"a")
        assert slot is not None
        pool.complete_write(slot, False)
        assert pool.lookup(b"a") is LookupResult.MISS
        assert pool.state(slot) is SlotState.FREE
        assert pool.key_of(slot) is None
        assert pool.statistics().free == 4
        assert pool.allocate(b"b") == slot  # lowest free slot first

    def test_allocating_a_mapped_key_raises(self, pool: BlockPool) -> None:
        pool.allocate(b"a")
        with pytest.raises(RuntimeError, match=r"already in slot 0"):
            pool.allocate(b"a")

    def test_complete_write_needs_a_writing_slot(self, pool: BlockPool) -> None:
        slot = ready(pool, b"a")
        with pytest.raises(RuntimeError, match=r"slot 0: it is ready, not writing"):
            pool.complete_write(slot, True)
        with pytest.raises(RuntimeError, match=r"it is free"):
            pool.complete_write(1, True)

    def test_statistics_count_states(self, pool: BlockPool) -> None:
        ready(pool, b"a")
        pool.pin([0])
        pool.allocate(b"b")
        stats = pool.statistics()
        assert stats == PoolStatistics(
            num_blocks=4, block_len=BLOCK, free=2, writing=1, ready=1, pinned=1, evictions=0
        )
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.free = 9  # type: ignore[misc]


class TestEviction:
    def test_least_recently_used_ready_slot_goes_first(self, pool: BlockPool) -> None:
        for index, key in enumerate([b"a", b"b", b"c", b"d"]):
            assert ready(pool, key) == index
        assert pool.lookup(b"a") is LookupResult.HIT  # a is now the most recent
        assert pool.allocate(b"e") == 1  # b was least recent
        assert pool.lookup(b"b") is LookupResult.MISS
        assert pool.allocate(b"f") == 2
        assert pool.statistics().evictions == 2

    def test_pinned_and_writing_slots_are_never_taken(self, pool: BlockPool) -> None:
        for key in [b"a", b"b", b"c"]:
            ready(pool, key)
        pool.pin([0, 1, 2])
        assert pool.allocate(b"d") == 3  # the free slot; now WRITING
        assert pool.allocate(b"e") is None
        pool.unpin([1])
        assert pool.allocate(b"e") == 1
        assert pool.lookup(b"b") is LookupResult.MISS
        assert pool.lookup(b"a") is LookupResult.HIT

    def test_slot_freed_by_failure_is_reused_before_eviction(self, pool: BlockPool) -> None:
        for key in [b"a", b"b", b"c"]:
            ready(pool, key)
        slot = pool.allocate(b"d")
        assert slot is not None
        pool.complete_write(slot, False)
        assert pool.allocate(b"e") == slot
        assert pool.statistics().evictions == 0


class TestPins:
    def test_pins_count_per_listing(self, pool: BlockPool) -> None:
        ready(pool, b"a")
        pool.pin([0, 0])
        pool.pin([0])
        assert pool.pin_count(0) == 3
        pool.unpin([0, 0])
        assert pool.pin_count(0) == 1
        assert pool.statistics().pinned == 1
        pool.unpin([0])
        assert pool.statistics().pinned == 0

    def test_unpin_below_zero_raises_and_changes_nothing(self, pool: BlockPool) -> None:
        ready(pool, b"a")
        ready(pool, b"b")
        pool.pin([0, 1])
        with pytest.raises(RuntimeError, match=r"unpin of slot 1 2 time\(s\).*pin count is 1"):
            pool.unpin([0, 1, 1])
        assert (pool.pin_count(0), pool.pin_count(1)) == (1, 1)

    def test_only_ready_slots_are_pinned(self, pool: BlockPool) -> None:
        ready(pool, b"a")
        pool.allocate(b"b")
        with pytest.raises(RuntimeError, match=r"cannot pin slot 1: it is writing"):
            pool.pin([0, 1])
        with pytest.raises(RuntimeError, match=r"cannot pin slot 2: it is free"):
            pool.pin([2])
        assert pool.pin_count(0) == 0  # all-or-nothing


class TestBytesAndErrors:
    def test_write_needs_a_writing_slot_and_a_full_block(self, pool: BlockPool) -> None:
        slot = pool.allocate(b"a")
        assert slot is not None
        with pytest.raises(ValueError, match=r"slot 0: data is 3 bytes, a block is 64"):
            pool.write(slot, b"abc")
        pool.write(slot, bytearray(block(2)))
        pool.complete_write(slot, True)
        with pytest.raises(RuntimeError, match=r"cannot write into slot 0: it is ready"):
            pool.write(slot, block(2))

    def test_read_needs_a_ready_slot(self, pool: BlockPool) -> None:
        pool.allocate(b"a")
        with pytest.raises(RuntimeError, match=r"cannot read slot 0: it is writing"):
            pool.read(0)

    @pytest.mark.parametrize("slot", [-1, 4, 100])
    def test_slot_out_of_range_is_named(self, pool: BlockPool, slot: int) -> None:
        message = rf"slot {slot} out of range \[0, 4\)"
        with pytest.raises(ValueError, match=message):
            pool.read(slot)
        with pytest.raises(ValueError, match=message):
            pool.slot_view(slot)
        with pytest.raises(ValueError, match=message):
            pool.unpin([slot])
        with pytest.raises(ValueError, match=message):
            pool.pin([slot])

    def test_non_int_slot_is_named(self, pool: BlockPool) -> None:
        with pytest.raises(ValueError, match=r"slot must be an int, got '1'"):
            pool.state("1")  # type: ignore[arg-type]


def test_close_removes_the_file_even_while_a_view_is_still_exported() -> None:
    """A data plane that did not let go (a stuck thread, a crashed driver) must not keep
    the region's file in /dev/shm: close removes it and leaves the mapping to the process."""
    path = f"/dev/shm/kvpeer-test-close-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pool = BlockPool(4, 4096, shm_path=path)
    held = pool.view[0:16]  # an export close() cannot undo
    try:
        pool.close()
        assert not os.path.exists(path)
    finally:
        held.release()


class TestWithhold:
    def test_withheld_slots_are_never_allocated_or_evicted(self) -> None:
        pool = BlockPool(6, 8)
        taken = pool.withhold(2)
        assert taken == [4, 5]
        slots = []
        for i in range(12):  # twice the pool's room: evictions happen
            slot = pool.allocate(b"k%02d" % i)
            assert slot is not None
            slots.append(slot)
            pool.complete_write(slot, True)
        assert not set(slots) & set(taken)
        stats = pool.statistics()
        assert stats.withheld == 2
        assert stats.free + stats.writing + stats.ready + stats.withheld == 6

    def test_more_than_is_free_is_refused_by_count(self) -> None:
        pool = BlockPool(3, 8)
        slot = pool.allocate(b"k")
        assert slot is not None
        with pytest.raises(ValueError, match="cannot withhold 3 slots: 2 are free"):
            pool.withhold(3)
        with pytest.raises(ValueError, match="count must be an int >= 0"):
            pool.withhold(-1)
        assert pool.statistics().withheld == 0
