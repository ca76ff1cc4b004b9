"""What changed in an engine's KV event feed, in words for the router's log.

KV-aware routing for an engine is on only while its feed is synced
(:class:`~kvpeer.router.feed.StreamSynced`); everything that turns it off or loses
events is counted in :class:`~kvpeer.router.feed.FeedStatistics`. A
:class:`FeedWatch` compares one engine's statistics with the last ones it saw and says
what changed, once:

1. synced -> not synced is a WARNING naming why (a gap, a new engine process, a batch
   refused and its reason); not synced -> synced is INFO.
2. Losses since the last look (gaps, incomplete replays, batches or frames dropped by
   reason) are one WARNING line, with counts.
3. A feed never synced ``unsynced_after_s`` after the watch began is one WARNING naming
   the endpoint (an engine that is down, or publishes elsewhere): routing to it is by
   load only until it syncs.

Sans-IO: the caller passes ``now`` and logs the lines it gets back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpeer.router.feed import FeedStatistics

__all__ = ["FeedNote", "FeedWatch"]

UNSYNCED_AFTER_S = 30.0


@dataclass(frozen=True, slots=True)
class FeedNote:
    """One line for the log: its level (``logging.INFO``, ``logging.WARNING``) and text."""

    level: int
    text: str


class FeedWatch:
    """One engine's feed, watched for changes worth a log line."""

    def __init__(self, engine: str, endpoint: str, now: float, *,
                 unsynced_after_s: float = UNSYNCED_AFTER_S) -> None:  # fmt: skip
        self._engine = engine
        self._endpoint = endpoint
        self._last: FeedStatistics | None = None
        self._began = now
        self._quiet_until: float | None = now + unsynced_after_s  # None: said, or synced

    def observe(self, stats: FeedStatistics, now: float) -> list[FeedNote]:
        """Lines for what changed since the last call (rules 1-3)."""
        last, self._last = self._last, stats
        notes: list[FeedNote] = []
        name = f"engine {self._engine}: KV events"
        if stats.synced:
            self._quiet_until = None
        elif self._quiet_until is not None and now >= self._quiet_until:
            self._quiet_until = None
            notes.append(FeedNote(logging.WARNING, (
                f"{name} not synced from {self._endpoint} after {now - self._began:.0f} s "
                "(engine down, or its --kv-events-config publishes elsewhere): routed by "
                "load only until they are")))
        if last is None:
            if stats.synced:
                notes.append(FeedNote(logging.INFO, f"{name} synced: KV-aware routing on"))
            return notes
        losses = _losses(last, stats)
        if last.synced and not stats.synced:
            why = _why(last, stats)
            notes.append(FeedNote(logging.WARNING, (
                f"{name} out of sync ({why}): what it holds is forgotten, routed by load "
                "only until resynced")))
        elif stats.synced and not last.synced:
            notes.append(FeedNote(logging.INFO, f"{name} synced: KV-aware routing on"))
        if losses:
            notes.append(FeedNote(logging.WARNING, f"{name} lost: {', '.join(losses)}"))
        return notes


def _why(last: FeedStatistics, stats: FeedStatistics) -> str:
    if stats.restarts > last.restarts:
        return "a new engine process"
    refused = _increase(last.dropped, stats.dropped)
    if refused:
        return "a batch dropped: " + ", ".join(refused)
    if stats.gaps > last.gaps:
        return "a gap in its sequence"
    return "a resync"


def _losses(last: FeedStatistics, stats: FeedStatistics) -> list[str]:
    out = []
    if stats.gaps > last.gaps:
        out.append(f"{stats.gaps - last.gaps} gap(s)")
    if stats.replays_incomplete > last.replays_incomplete:
        out.append(f"{stats.replays_incomplete - last.replays_incomplete} incomplete replay(s)")
    dropped = _increase(last.dropped, stats.dropped)
    if dropped:
        out.append("dropped " + ", ".join(dropped))
    return out


def _increase(before: tuple[tuple[str, int], ...],
              after: tuple[tuple[str, int], ...]) -> list[str]:  # fmt: skip
    """``reason N`` for each reason whose count grew."""
    old = dict(before)
    return [f"{reason} {count - old.get(reason, 0)}" for reason, count in after
            if count > old.get(reason, 0)]
