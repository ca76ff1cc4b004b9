"""Monotonic event counters and histograms the tier keeps for its metrics.

Invariants:

1. Everything here only grows (counters, histogram buckets, sums): a reader
   takes a :meth:`TierCounters.snapshot` and computes deltas itself, so any
   number of readers (a Prometheus scrape, vLLM's ``get_stats``) coexist.
2. No Prometheus or vLLM object lives here: readers translate snapshots.
3. Counts of a session survive its end: what a closed session counted
   (blocks served, timeouts, unknown messages) is folded into ``retired``.
4. A histogram keeps its last :data:`RECENT` observations so that a reader
   that needs raw samples (vLLM's IPC) can take the ones since its last read.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpeer.session import SessionStatistics

__all__ = [
    "AHEAD_EVENTS",
    "FETCH_SECONDS_BUCKETS",
    "FETCH_SIZE_BUCKETS",
    "LOOKUP_SECONDS_BUCKETS",
    "PEER_LOOKUP_PATHS",
    "PULL_WAIT_OUTCOMES",
    "PULL_WAIT_SECONDS_BUCKETS",
    "STEP_WAIT_SECONDS_BUCKETS",
    "CounterSnapshot",
    "EventCounter",
    "Histogram",
    "HistogramSnapshot",
    "TierCounters",
]

#: Raw observations a histogram keeps for readers that need samples (invariant 4).
RECENT = 4096
LOOKUP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                          2.5, 5.0, 10.0, 30.0)  # fmt: skip
FETCH_SECONDS_BUCKETS = LOOKUP_SECONDS_BUCKETS
STEP_WAIT_SECONDS_BUCKETS = LOOKUP_SECONDS_BUCKETS
PULL_WAIT_SECONDS_BUCKETS = LOOKUP_SECONDS_BUCKETS
PULL_WAIT_OUTCOMES = ("landed", "missed")  # the engine's wait in a lookup for a pull
#: How the tier answered a peer's lookup (a resolve fetch's included): at once from held
#: blocks on the node's thread, or in one of the engine's serve windows.
PEER_LOOKUP_PATHS = ("held", "engine")
#: What pulling ahead counted (kvpeer.node.ahead): prefetches received and refused,
#: blocks fetched, staged, used by the engine, expired unused or evicted for room,
#: fetches failed, engine jobs served from staging or failed there, or given up on
#: (still waiting for their fetch at the router's ``give_up_s``: the engine computes).
AHEAD_EVENTS = ("prefetches", "refused", "already_staged", "blocks_fetched", "blocks_staged",
                "blocks_used", "blocks_expired", "blocks_evicted", "fetches_failed",
                "jobs_served", "jobs_adopted", "jobs_failed", "jobs_given_up")  # fmt: skip
FETCH_SIZE_BUCKETS = tuple(float(4096 * 4**i) for i in range(10))  # 4 KiB .. 1 GiB


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """``counts[i]``: observations <= ``buckets[i]`` (not cumulative); the last
    entry of ``counts`` is the overflow (> the last bound)."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    count: int
    recent: tuple[float, ...]


class Histogram:
    """Fixed buckets, a sum, a count and the most recent raw observations."""

    __slots__ = ("_buckets", "_count", "_counts", "_recent", "_total")

    def __init__(self, buckets: Sequence[float]) -> None:
        self._buckets = tuple(float(b) for b in buckets)
        if list(self._buckets) != sorted(set(self._buckets)):
            raise ValueError(f"bucket bounds must increase: {self._buckets}")
        self._counts = [0] * (len(self._buckets) + 1)
        self._total = 0.0
        self._count = 0
        self._recent: deque[float] = deque(maxlen=RECENT)

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._buckets, value)] += 1
        self._total += value
        self._count += 1
        self._recent.append(value)

    @property
    def count(self) -> int:
        return self._count

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(
            self._buckets, tuple(self._counts), self._total, self._count, tuple(self._recent)
        )


class EventCounter(Counter[str]):
    """A Counter that also counts its own updates (``changes``): one int a reader may
    read without the node's lock, where summing the values would iterate a dict
    another thread may be adding a key to."""

    __slots__ = ("changes",)

    def __init__(self) -> None:
        super().__init__()
        self.changes = 0

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        self.changes += 1


@dataclass(slots=True)
class TierCounters:
    """What the tier counts as events happen (one instance per tier)."""

    lookups: Counter[str] = field(default_factory=Counter)  # by LookupResult name, lower
    loads_ok: int = 0
    loads_failed: int = 0
    sessions_opened: int = 0
    late_fetches_rejected: int = 0
    stores_reaped: int = 0
    retired_blocks_served: int = 0
    retired_unknown_messages: int = 0
    retired_stale_frames: int = 0
    retired_peer_lookups: Counter[str] = field(default_factory=Counter)  # by PEER_LOOKUP_PATHS
    retired_timeouts: Counter[str] = field(default_factory=Counter)
    timeouts: EventCounter = field(default_factory=EventCounter)  # tier-level kinds
    lookup_seconds: Histogram = field(default_factory=lambda: Histogram(LOOKUP_SECONDS_BUCKETS))
    load_seconds: Histogram = field(default_factory=lambda: Histogram(FETCH_SECONDS_BUCKETS))
    load_bytes: Histogram = field(default_factory=lambda: Histogram(FETCH_SIZE_BUCKETS))
    #: peer work waiting for the engine's serve window, per peer and window
    step_wait_seconds: Histogram = field(
        default_factory=lambda: Histogram(STEP_WAIT_SECONDS_BUCKETS)
    )
    #: the engine's scheduler waiting, in a lookup, for a pull it submitted at once
    pull_waits: EventCounter = field(default_factory=EventCounter)  # by PULL_WAIT_OUTCOMES
    pull_wait_seconds: Histogram = field(
        default_factory=lambda: Histogram(PULL_WAIT_SECONDS_BUCKETS)
    )
    ahead: EventCounter = field(default_factory=EventCounter)  # by AHEAD_EVENTS

    def activity(self) -> int:
        """A number that grows whenever a load, lookup answer, session event, tier
        timeout, pull wait, peer's wait for a step or pulling-ahead event is counted
        (an adoption of staged blocks copies nothing and counts no load: without its
        term, vLLM's ``get_stats`` left it off ``/metrics`` until a second later, and
        for good if that was the engine's last step).

        Read without the node's lock: each term is one int read, and a stale sum only
        means the change is noticed on the reader's next call."""
        return (
            self.loads_ok + self.loads_failed + self.sessions_opened
            + self.late_fetches_rejected + self.stores_reaped
            + self.lookup_seconds.count + self.load_seconds.count
            + self.timeouts.changes + self.pull_wait_seconds.count
            + self.step_wait_seconds.count + self.ahead.changes
        )  # fmt: skip

    def retire(self, stats: SessionStatistics) -> None:
        """Keep what an ending session counted (invariant 3)."""
        self.retired_blocks_served += stats.producer.blocks_written
        self.retired_unknown_messages += stats.unknown_messages
        self.retired_stale_frames += stats.stale_frames
        self.retired_timeouts.update(stats.consumer.timeouts)
        self.retired_timeouts.update(stats.producer.timeouts)
        self.retired_peer_lookups.update(_peer_lookups(stats))

    def snapshot(
        self, live: Iterable[SessionStatistics], handshake_timeouts: int
    ) -> CounterSnapshot:
        """Since-start values: what ended sessions counted plus the ``live`` ones'
        (invariant 3), and ``handshake_timeouts`` sessions that timed out shaking hands."""
        served, unknown = self.retired_blocks_served, self.retired_unknown_messages
        timeouts: Counter[str] = Counter()
        timeouts.update(self.retired_timeouts)
        timeouts.update(self.timeouts)
        peer_lookups = Counter(self.retired_peer_lookups)
        for stats in live:
            peer_lookups.update(_peer_lookups(stats))
            served += stats.producer.blocks_written
            unknown += stats.unknown_messages
            timeouts.update(stats.consumer.timeouts)
            timeouts.update(stats.producer.timeouts)
        timeouts["handshake"] += handshake_timeouts
        return CounterSnapshot(
            lookups=dict(self.lookups),
            loads_ok=self.loads_ok,
            loads_failed=self.loads_failed,
            sessions_opened=self.sessions_opened,
            late_fetches_rejected=self.late_fetches_rejected,
            stores_reaped=self.stores_reaped,
            blocks_served=served,
            unknown_messages=unknown,
            timeouts=dict(timeouts),
            lookup_seconds=self.lookup_seconds.snapshot(),
            load_seconds=self.load_seconds.snapshot(),
            load_bytes=self.load_bytes.snapshot(),
            step_wait_seconds=self.step_wait_seconds.snapshot(),
            pull_waits=dict(self.pull_waits),
            pull_wait_seconds=self.pull_wait_seconds.snapshot(),
            ahead=dict(self.ahead),
            peer_lookups=dict(peer_lookups),
        )


def _peer_lookups(stats: SessionStatistics) -> dict[str, int]:
    """One session's peer lookups by :data:`PEER_LOOKUP_PATHS`."""
    return {"held": stats.producer.lookups_from_held, "engine": stats.producer.lookups_to_engine}


@dataclass(frozen=True, slots=True)
class CounterSnapshot:
    """Frozen, since-start values of :class:`TierCounters` plus live sessions' counts."""

    lookups: dict[str, int]
    loads_ok: int
    loads_failed: int
    sessions_opened: int
    late_fetches_rejected: int
    stores_reaped: int
    blocks_served: int
    unknown_messages: int
    timeouts: dict[str, int]
    lookup_seconds: HistogramSnapshot
    load_seconds: HistogramSnapshot
    load_bytes: HistogramSnapshot
    step_wait_seconds: HistogramSnapshot
    pull_waits: dict[str, int]
    pull_wait_seconds: HistogramSnapshot
    ahead: dict[str, int] = field(default_factory=dict)
    peer_lookups: dict[str, int] = field(default_factory=dict)  # by PEER_LOOKUP_PATHS
