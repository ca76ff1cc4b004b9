"""WorkMap / WorkSet: ordered, and their footprint follows what they hold now."""

from __future__ import annotations

import sys

from kvpeer.session.worklist import WorkMap, WorkSet


class TestWorkMap:
    def test_keeps_insertion_order_and_first(self) -> None:
        work: WorkMap[str, int] = WorkMap()
        for i, key in enumerate("cab"):
            work[key] = i
        assert list(work) == ["c", "a", "b"]
        assert work.first() == ("c", 0)
        del work["c"]
        assert work.first() == ("a", 1)
        assert work.pop("zz") is None
        assert work.pop("a") == 1
        assert work.items() == [("b", 2)]

    def test_iteration_is_a_snapshot(self) -> None:
        work: WorkMap[int, None] = WorkMap()
        for i in range(10):
            work[i] = None
        for key in work:
            del work[key]
        assert not work
        assert work.first() is None

    def test_footprint_shrinks_after_mass_removal(self) -> None:
        work: WorkMap[int, int] = WorkMap()
        empty = sys.getsizeof(work)
        for i in range(100_000):
            work[i] = i
        full = sys.getsizeof(work)
        for i in range(99_990):
            del work[i]
        assert sys.getsizeof(work) < full // 100
        assert list(work) == list(range(99_990, 100_000))
        for i in range(99_990, 100_000):
            work.pop(i)
        assert sys.getsizeof(work) <= empty


class TestWorkSet:
    def test_add_discard_contains(self) -> None:
        work: WorkSet[str] = WorkSet()
        work.add("x")
        work.add("y")
        work.add("x")
        assert len(work) == 2
        assert "x" in work
        work.discard("x")
        work.discard("never")
        assert list(work) == ["y"]
        work.clear()
        assert not work
