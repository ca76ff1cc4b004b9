"""A cache of blocks by id, least recently used first out.

Invariants: it never holds more than ``capacity`` blocks after any call; ``insert``
returns exactly the ids it evicted, oldest first (the engine announces them as KV
events); ``touch`` refreshes without inserting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["BlockLru"]


class BlockLru:
    def __init__(self, capacity: int | None) -> None:
        """``capacity`` in blocks; None: infinite."""
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def prefix(self, blocks: Sequence[int], limit: int | None = None) -> int:
        """How many of ``blocks`` (at most ``limit``) it holds from the first on."""
        held = self._blocks
        end = len(blocks) if limit is None else min(limit, len(blocks))
        for i in range(end):
            if blocks[i] not in held:
                return i
        return end

    def touch(self, blocks: Iterable[int]) -> None:
        held = self._blocks
        for block in blocks:
            if block in held:
                held.move_to_end(block)

    def insert(self, blocks: Iterable[int]) -> tuple[list[int], list[int]]:
        """Insert (or refresh) ``blocks``; (the ids new to it, the ids evicted)."""
        held = self._blocks
        new: list[int] = []
        for block in blocks:
            if block in held:
                held.move_to_end(block)
            else:
                new.append(block)
                held[block] = None
        return new, self.shrink(self.capacity)

    def shrink(self, capacity: int | None) -> list[int]:
        """Evict oldest first down to ``capacity`` blocks (None: nothing)."""
        if capacity is None:
            return []
        held = self._blocks
        evicted: list[int] = []
        while len(held) > max(0, capacity):
            evicted.append(held.popitem(last=False)[0])
        return evicted
