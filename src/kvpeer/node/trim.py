"""Freed heap memory handed back to the system, at a bounded rate (issue 30, item 3).

A node's memory is touched by many threads: the driver decodes frames, libzmq's I/O
thread receives them, data-plane threads read and write block streams, the reaper
forgets peers. glibc gives each thread that allocates its own arena (up to eight per
core) and keeps what is freed in it for reuse; it gives memory back to the system only
from the top of the main heap, past a threshold that grows with the largest block it
ever freed. A node that a hostile network drives hard (a million generated frames:
short-lived sessions, frames up to the size limit, connections and threads opened and
closed by the thousand) so keeps the high-water mark of every arena resident, long
after the objects are gone (``kvpeer fuzz``: 62 MiB after the warm-up, 169 MiB after
10^6 frames and the goodbyes; with one arena, ``MALLOC_ARENA_MAX=1``, +3 MiB over
10^5 frames against +22 MiB: docs/benchmarks.md).

Two remedies, both for a process the node owns (``kvpeer serve``; never inside an
engine, whose heap is the engine's): :func:`cap_malloc_arenas` caps glibc's arenas
before the node starts its threads (``M_ARENA_MAX``; Python's own allocations run
under the GIL anyway, so one arena costs them no contention), which is what bounds the
growth; and :class:`HeapTrimmer` hands freed pages back while the node runs: glibc's
``malloc_trim(0)`` returns the free pages of every arena, not only the top of the main
heap (alone it does not bound the growth: freed and live pieces share pages across
the many arenas). The trimmer's invariants:

1. It looks at most once per ``every_s`` (one read of ``/proc/self/statm``) and trims
   only when resident memory grew by ``min_growth`` since the last trim left it: an
   idle node never pays for a trim, and one that only holds more live data pays one
   per ``min_growth`` of it. After a trim that took ``d`` seconds it looks again no
   sooner than ``d / MAX_DUTY`` (at most 1 % of the driver's time goes to trims).
2. It runs on the driver thread outside the node's lock (no engine call or frame waits
   on it); glibc takes each arena's own lock while it trims that arena.
3. Where there is no glibc or no ``/proc`` it does nothing and says so
   (:attr:`HeapTrimmer.available`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "HeapTrimmer",
    "TrimStatistics",
    "cap_malloc_arenas",
    "glibc_malloc_trim",
    "resident_bytes",
]

#: How often the driver looks, and by how much resident memory must have grown.
TRIM_EVERY_S = 1.0
TRIM_MIN_GROWTH = 8 << 20
#: The share of wall time trims may take (invariant 1).
MAX_DUTY = 0.01
_PAGE = os.sysconf("SC_PAGE_SIZE")


_M_ARENA_MAX = -8  # glibc's mallopt parameter


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def cap_malloc_arenas(arenas: int) -> bool:
    """At most ``arenas`` glibc malloc arenas in this process from now on (call it
    before threads start); False where the C library has no ``mallopt``."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))


def glibc_malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


def resident_bytes() -> int | None:
    """This process's resident memory (``/proc/self/statm``), or None without ``/proc``."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True, slots=True)
class TrimStatistics:
    available: bool
    trims: int
    returned_bytes: int  # resident memory the trims gave back, in all
    seconds: float  # spent in malloc_trim, in all


class HeapTrimmer:
    """Trims when resident memory grew past the last trim's (invariant 1)."""

    def __init__(
        self,
        trim: Callable[[], object] | None,
        resident: Callable[[], int | None] = resident_bytes,
        *,
        every_s: float = TRIM_EVERY_S,
        min_growth: int = TRIM_MIN_GROWTH,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        first = resident() if trim is not None else None
        self._trim = trim if first is not None else None
        self._resident = resident
        self._every_s = every_s
        self._min_growth = min_growth
        self._clock = clock
        self._looked_at = clock()
        self._baseline = first or 0
        self._trims = 0
        self._returned = 0
        self._seconds = 0.0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def due(self, now: float) -> bool:
        """Whether it is time to look (cheap: the caller asks before every sleep)."""
        return self._trim is not None and now - self._looked_at >= self._every_s

    def look(self, now: float) -> bool:
        """Read resident memory and trim if it grew enough; whether it trimmed (no lock
        held: invariant 2)."""
        self._looked_at = now
        if self._trim is None:
            return False
        before = self._resident()
        if before is None:
            return False
        if before < self._baseline + self._min_growth:
            self._baseline = min(self._baseline, before)  # it shrank by itself
            return False
        started = self._clock()
        self._trim()
        took = self._clock() - started
        self._seconds += took
        self._looked_at = now + max(0.0, took / MAX_DUTY - self._every_s)
        after = self._resident()
        self._baseline = after if after is not None else before
        self._trims += 1
        self._returned += max(0, before - self._baseline)
        return True

    def statistics(self) -> TrimStatistics:
        return TrimStatistics(self.available, self._trims, self._returned, self._seconds)
