"""Freed heap memory handed back while a node is busy (``kvpeer.node.trim``, issue 30 item 3).

The rule with a fake clock and fake resident sizes; that the driver thread trims,
outside the lock, once memory grew; and glibc's ``malloc_trim`` on this machine: memory that threads
freed in their own arenas, pinned there by a few live objects, stays resident until a
trim returns it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvpeer.node.loop import NodeLoop
from kvpeer.node.trim import HeapTrimmer, glibc_malloc_trim, resident_bytes
from tests.node.test_loop import FakeSource

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_it_trims_when_resident_memory_grew_and_looks_once_per_interval() -> None:
    clock, trims = Clock(), []
    rss = [100 * MiB]

    def trim() -> None:
        trims.append(clock.now)
        rss[0] = 101 * MiB  # what was freed went back

    trimmer = HeapTrimmer(
        trim, lambda: rss[0], every_s=1.0, min_growth=8 * MiB, clock=clock
    )
    assert not trimmer.due(100.5)
    assert trimmer.due(101.0)
    rss[0] = 107 * MiB  # grew, not enough
    assert not trimmer.look(101.0)
    assert not trimmer.due(101.5)  # looked a moment ago
    rss[0] = 108 * MiB
    assert trimmer.look(102.0)
    assert trims == [100.0]  # the trim's own clock
    rss[0] = 108 * MiB  # grew again by 7 MiB over the 101 the trim left
    assert not trimmer.look(103.0)
    stats = trimmer.statistics()
    assert (stats.available, stats.trims, stats.returned_bytes) == (True, 1, 7 * MiB)


def test_an_idle_node_never_trims() -> None:
    trims: list[int] = []
    trimmer = HeapTrimmer(lambda: trims.append(1), lambda: 50 * MiB, every_s=0.0)
    for now in range(1000):
        assert not trimmer.look(float(now))
    assert trims == []


def test_without_glibc_or_proc_nothing_is_ever_due() -> None:
    for trimmer in (
        HeapTrimmer(None, lambda: 1, every_s=0.0),
        HeapTrimmer(lambda: None, lambda: None, every_s=0.0),
    ):
        assert not trimmer.available
        assert not trimmer.due(10.0**9)
        assert not trimmer.look(10.0**9)
        assert trimmer.statistics().trims == 0


def test_the_driver_trims_outside_the_lock_once_memory_grew() -> None:
    source = FakeSource()
    held: list[bool] = []
    done = threading.Event()
    rss = [10 * MiB]
    loop: NodeLoop | None = None

    def trim() -> None:
        assert loop is not None
        held.append(loop.lock.locked())
        done.set()

    trimmer = HeapTrimmer(trim, lambda: rss[0], every_s=0.0, min_growth=MiB, clock=lambda: 0.0)
    loop = NodeLoop(
        source, source.poll, clock=lambda: 0.0, max_wait_s=3600.0, block=source.block,
        trimmer=trimmer,
    )
    loop.start()
    try:
        source.until_settled(1)
        assert not done.is_set()  # nothing grew
        rss[0] = 12 * MiB
        os.eventfd_write(source.frame_fd, 1)
        source.until_settled(2)
        assert done.wait(10.0)
        assert held == [False]
        stats = loop.heap_trims
        assert stats is not None
        assert stats.trims == 1
    finally:
        loop.stop()
        with loop.lock:
            loop.close()
        source.close()


def _rss() -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


@pytest.mark.skipif(glibc_malloc_trim() is None, reason="no glibc malloc_trim here")
def test_glibc_returns_what_threads_freed_in_their_arenas() -> None:
    """Four threads each allocate 24 MiB in 2 KiB pieces (past pymalloc: glibc's, in
    the thread's own arena), keep every 64th and free the rest: the kept pieces pin
    the arenas' pages, so glibc keeps them all resident, until ``malloc_trim``."""
    trim = glibc_malloc_trim()
    assert trim is not None
    assert resident_bytes() is not None
    kept: list[list[bytes]] = []
    lock = threading.Lock()

    def churn() -> None:
        pieces = [bytes(2048) for _ in range(12 * 1024)]
        with lock:
            kept.append(pieces[::64])
        pieces.clear()

    trim()
    before = _rss()
    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    freed_but_resident = _rss() - before
    trim()
    after = _rss() - before

    assert freed_but_resident > 48 * MiB, freed_but_resident / MiB
    assert after < freed_but_resident / 4, (freed_but_resident / MiB, after / MiB)
    assert sum(len(k) for k in kept) == 4 * 12 * 1024 // 64


def test_a_slow_trim_pushes_the_next_look_back() -> None:
    """A trim that took 0.5 s (a big fragmented heap) is followed by no look for 50 s:
    at most 1 % of the driver's time goes to trims."""
    clock = Clock()
    rss = [100 * MiB]

    def trim() -> None:
        clock.now += 0.5
        rss[0] = 100 * MiB

    trimmer = HeapTrimmer(trim, lambda: rss[0], every_s=1.0, min_growth=MiB, clock=clock)
    rss[0] = 120 * MiB
    assert trimmer.look(101.0)
    assert not trimmer.due(101.0 + 49.9)
    assert trimmer.due(101.0 + 50.0)


@pytest.mark.skipif(glibc_malloc_trim() is None, reason="no glibc here")
def test_the_arena_cap_is_taken_by_glibc_in_a_fresh_process() -> None:
    """The cap is process-wide, so it is tried in a child (``kvpeer serve`` calls it
    before its threads start); what it bounds is measured by scripts/fuzz_memory.py."""
    script = "from kvpeer.node.trim import cap_malloc_arenas; print(cap_malloc_arenas(1))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, env=env,
        timeout=60,
    )
    assert done.stdout.strip() == "True"
