"""Work lists whose cost follows what they hold now, not what they once held.

CPython dicts and sets keep their table after deletions: iterating a set that
once held 10,000 ids and now holds none still walks 10,000 slots, and finding
the first entry of an insertion-ordered dict walks every deleted entry before
it. :class:`WorkMap` rebuilds its dict once it has shrunk to a quarter of its
high-water mark, so iteration and :meth:`WorkMap.first` stay proportional to
the live entries (amortised O(1) per removal). Insertion order is kept, which
the timers rely on (oldest first).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["WorkMap", "WorkSet"]

K = TypeVar("K")
V = TypeVar("V")


class WorkMap(Generic[K, V]):
    """An insertion-ordered mapping that trims itself as it empties."""

    __slots__ = ("_high", "_items")

    def __init__(self) -> None:
        self._items: dict[K, V] = {}
        self._high = 0

    def __setitem__(self, key: K, value: V) -> None:
        self._items[key] = value
        self._high = max(self._high, len(self._items))

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __delitem__(self, key: K) -> None:
        del self._items[key]
        self._trim()

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[K]:
        """Iterate over a snapshot of the keys (safe to mutate meanwhile)."""
        return iter(list(self._items)) if self._items else iter(())  # mostly empty

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._items.get(key, default)

    def pop(self, key: K, default: V | None = None) -> V | None:
        if key not in self._items:
            return default
        value = self._items.pop(key)
        self._trim()
        return value

    def items(self) -> list[tuple[K, V]]:
        return list(self._items.items())

    def values(self) -> list[V]:
        return list(self._items.values())

    def first(self) -> tuple[K, V] | None:
        """The oldest entry still present."""
        for item in self._items.items():
            return item
        return None

    def clear(self) -> None:
        self._items = {}
        self._high = 0

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + sys.getsizeof(self._items)

    def _trim(self) -> None:
        size = len(self._items)
        if size == 0:
            self._items = {}
            self._high = 0
        elif size * 4 < self._high:
            self._items = dict(self._items)
            self._high = size


class WorkSet(WorkMap[K, None]):
    """An insertion-ordered set that trims itself as it empties: a :class:`WorkMap`
    whose values are all None (a subclass, not a wrapper: the timers test and walk
    these sets on every poll, and a wrapper doubles each call)."""

    __slots__ = ()

    def add(self, key: K) -> None:
        self[key] = None

    def discard(self, key: K) -> None:
        self.pop(key)
