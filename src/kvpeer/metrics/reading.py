"""Read a node's numbers once (under its lock) and turn them into catalog values.

A :class:`NodeReading` is a frozen copy taken at scrape time; :func:`values`
maps it onto the catalog: ``{name: {label values: number or histogram}}`` with
every series of the catalog present (invariant 1 of :mod:`kvpeer.metrics.catalog`).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

from kvpeer import __version__
from kvpeer.metrics.catalog import (
    CATALOG,
    CLOSE_KINDS,
    INFO,
    LOOKUP_RESULTS,
    PROTOCOL_ERROR_REASONS,
    TIMEOUT_KINDS,
    MetricType,
)
from kvpeer.node.counters import (
    AHEAD_EVENTS,
    PEER_LOOKUP_PATHS,
    PULL_WAIT_OUTCOMES,
    CounterSnapshot,
    HistogramSnapshot,
)
from kvpeer.node.driver import DrivenTier
from kvpeer.node.tier import Tier, TierStatistics
from kvpeer.protocol import PROTOCOL_VERSION

__all__ = ["NodeReading", "ThreadCpu", "Value", "read_node", "read_tier", "values"]

Value = float | HistogramSnapshot
THREAD_PREFIX = "kvpeer"


class ThreadCpu:
    """CPU seconds of this process's threads named ``kvpeer*``, monotonic.

    Python 3.11 does not name OS threads, so threads are found through
    :mod:`threading` (name, native id) and read from ``/proc/self/task/<tid>/stat``.
    A thread that ended keeps its last reading (only its final slice is lost).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}
        self._retired = 0.0
        self._tick = os.sysconf("SC_CLK_TCK")

    def seconds(self) -> float:
        with self._lock:
            seen: dict[int, float] = {}
            for thread in threading.enumerate():
                tid = thread.native_id
                if tid is None or not thread.name.startswith(THREAD_PREFIX):
                    continue
                try:
                    with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                        fields = stat.read().rpartition(b")")[2].split()
                except OSError:
                    continue  # ended since enumerate()
                seen[tid] = (int(fields[11]) + int(fields[12])) / self._tick
            for tid, last in self._last.items():
                if tid not in seen:
                    self._retired += last
            self._last = seen
            return self._retired + sum(seen.values())


@dataclass(frozen=True, slots=True)
class NodeReading:
    statistics: TierStatistics
    counters: CounterSnapshot
    wakeups: int
    cpu_seconds: float
    block_len: int
    data_planes: tuple[str, ...]
    engine_wait_s: float  # the tier's engine_wait_s, +Inf when null (no bound)


def read_node(node: DrivenTier, cpu: ThreadCpu) -> NodeReading:
    """One consistent reading of ``node`` (holds its lock for the tier's part only)."""
    with node.locked():
        return read_tier(node.tier, cpu, node.wakeups)


def read_tier(tier: Tier, cpu: ThreadCpu, wakeups: int = 0) -> NodeReading:
    """One reading of a bare ``tier``; the caller holds whatever lock guards it."""
    statistics = tier.statistics()
    counters = tier.counters()
    planes = tuple(tier.data_planes)
    wait = math.inf if tier.engine_wait_s is None else tier.engine_wait_s
    return NodeReading(statistics, counters, wakeups, cpu.seconds(), tier.block_len, planes, wait)


def _by(keys: tuple[str, ...], counts: dict[str, int]) -> dict[tuple[str, ...], Value]:
    return {(key,): float(counts.get(key, 0)) for key in keys}


def _one(value: float | int) -> dict[tuple[str, ...], Value]:
    return {(): float(value)}


def values(reading: NodeReading) -> dict[str, dict[tuple[str, ...], Value]]:
    """Every catalog series for ``reading``."""
    s, c = reading.statistics, reading.counters
    ended = s.sessions_ended
    errors = {reason: ended.get(reason, 0) for reason in PROTOCOL_ERROR_REASONS}
    errors["unknown_message"] = c.unknown_messages
    errors["stray_frame"] = s.stray_frames
    out: dict[str, dict[tuple[str, ...], Value]] = {
        "lookups_total": _by(LOOKUP_RESULTS, {k.lower(): v for k, v in c.lookups.items()}),
        "lookup_duration_seconds": {(): c.lookup_seconds},
        "fetches_total": {("ok",): float(c.loads_ok), ("failed",): float(c.loads_failed)},
        "fetch_duration_seconds": {(): c.load_seconds},
        "fetch_size_bytes": {(): c.load_bytes},
        "pulled_blocks_total": _one(s.blocks_loaded),
        "pulled_bytes_total": _one(s.blocks_loaded * reading.block_len),
        "served_blocks_total": _one(c.blocks_served),
        "served_bytes_total": _one(c.blocks_served * reading.block_len),
        "peer_step_wait_seconds": {(): c.step_wait_seconds},
        "peer_lookups_total": _by(PEER_LOOKUP_PATHS, c.peer_lookups),
        "engine_wait_seconds": _one(reading.engine_wait_s),
        "pull_waits_total": _by(PULL_WAIT_OUTCOMES, c.pull_waits),
        "pull_wait_seconds": {(): c.pull_wait_seconds},
        "sessions": _one(s.sessions),
        "session_events_total": {
            ("opened",): float(c.sessions_opened),
            ("closed",): float(sum(ended.values())),
            ("refused",): float(s.peers_refused),
        },
        "sessions_closed_total": _by(CLOSE_KINDS, ended),
        "timeouts_total": _by(TIMEOUT_KINDS, c.timeouts),
        "late_fetches_rejected_total": _one(c.late_fetches_rejected),
        "unbound_stores_reaped_total": _one(c.stores_reaped),
        "tombstones": _one(s.tombstones),
        "loads_in_flight": _one(s.loads_in_flight),
        "transfers_in_flight": _one(s.transfers_in_flight),
        "pinned_blocks": _one(s.pinned_blocks),
        "held_blocks": _one(s.held_blocks),
        "held_bytes": _one(s.held_bytes),
        "staged_blocks": _one(s.staged_blocks),
        "pull_ahead_total": _by(AHEAD_EVENTS, c.ahead),
        "parked_stores": _one(s.parked_batches),
        "protocol_errors_total": _by(PROTOCOL_ERROR_REASONS, errors),
        "idle_wakeups_total": _one(reading.wakeups),
        "thread_cpu_seconds_total": _one(reading.cpu_seconds),
        INFO: {(__version__, str(PROTOCOL_VERSION), ",".join(reading.data_planes)): 1.0},
    }
    assert out.keys() == {m.name for m in CATALOG}, "catalog and reading disagree"
    for metric in CATALOG:
        if metric.type is MetricType.HISTOGRAM:
            assert all(isinstance(v, HistogramSnapshot) for v in out[metric.name].values())
    return out
