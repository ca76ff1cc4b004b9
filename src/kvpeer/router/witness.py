"""What tells a returning engine's process, same or new: its event feed, its start time.

Both are :class:`~kvpeer.router.health.ProcessWitness` es (health rule 3).

**The KV-event feed** (:class:`FeedWitness`). When an engine's health check fails, the
witness keeps the feed's :class:`Anchor` (the last batch applied before the engine went
down). When the check passes again, the subscriber asks the engine's replay endpoint for
every batch from the anchor's ``seq``: the same process replays that very batch, byte
for byte (feed invariant 5): SAME. NEW: a publisher that holds other bytes at that
``seq``, nothing from it on, or whose ``seq`` went back (a new process, even one that
already counted past the old position: a forward gap that ``seq`` alone would have taken
for lost events). UNKNOWN: no event feed, no replay endpoint, nothing applied before it
went down (no anchor), a buffer that no longer reaches back to the anchor, a replay
already under way. The event stream is published by the engine core itself.

**The API server's start time** (:class:`StartTimeWitness`): ``process_start_time_seconds``
on the engine's ``/metrics``, read when the engine is first up and again when it
returns. vLLM's API server exits when its engine core dies (unless an operator sets
``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``, and then its ``/health`` answers 503 for good), so a
new engine core comes with a new API server: an unchanged start time is the same process
(SAME), a changed one a new process (NEW). UNKNOWN when either reading is missing: with
``--api-server-count`` > 1 vLLM's metrics come from prometheus' multiprocess registry,
which has no process series, and a loaded API server may not answer in time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import aiohttp

from kvpeer.router.feed import Anchor, Continuity
from kvpeer.router.subscriber import EventSubscriber

__all__ = ["MAX_METRICS_BYTES", "START_TIME_SERIES", "FeedWitness", "StartTimeWitness",
           "start_time"]

START_TIME_SERIES = "process_start_time_seconds"
MAX_METRICS_BYTES = 4 << 20  # read no further into a /metrics page looking for it


class FeedWitness:
    """Proves a returning engine unchanged, or new, through its event feed."""

    def __init__(self, subscribers: Mapping[str, EventSubscriber]) -> None:
        self._subscribers = subscribers
        self._anchors: dict[str, Anchor | None] = {}

    async def came_up(self, name: str) -> None:
        return None  # the feed follows the engine by itself

    def went_down(self, name: str) -> None:
        subscriber = self._subscribers.get(name)
        self._anchors[name] = subscriber.anchor() if subscriber is not None else None

    async def same_process(self, name: str) -> Continuity:
        subscriber = self._subscribers.get(name)
        anchor = self._anchors.pop(name, None)
        if subscriber is None:
            return Continuity.UNKNOWN  # no event feed: nothing to ask
        return await subscriber.verify(anchor)


class StartTimeWitness:
    """Tells a returning engine's API server by its start time (see the module doc)."""

    def __init__(self, urls: Mapping[str, str],
                 session: Callable[[], aiohttp.ClientSession]) -> None:
        self._urls = urls
        self._session = session
        self._known: dict[str, float] = {}

    async def came_up(self, name: str) -> None:
        reading = await start_time(self._session(), self._urls[name])
        if reading is not None:
            self._known[name] = reading

    def went_down(self, name: str) -> None:
        return None  # nothing can be read from an engine that does not answer

    async def same_process(self, name: str) -> Continuity:
        known = self._known.get(name)
        reading = await start_time(self._session(), self._urls[name])
        if reading is None:
            return Continuity.UNKNOWN
        self._known[name] = reading
        if known is None:
            return Continuity.UNKNOWN
        return Continuity.SAME if reading == known else Continuity.NEW


async def start_time(session: aiohttp.ClientSession, url: str) -> float | None:
    """``process_start_time_seconds`` from ``url``'s ``/metrics``; None if it has none (or
    not a finite positive number within the first :data:`MAX_METRICS_BYTES`). Errors of
    the request propagate: the caller bounds and judges them."""
    async with session.get(f"{url}/metrics") as response:
        if response.status != 200:
            return None
        read = 0
        async for line in response.content:
            read += len(line)
            if read > MAX_METRICS_BYTES:
                return None
            if not line.startswith(START_TIME_SERIES.encode()):
                continue
            name, _, value = line.decode("ascii", "replace").strip().partition(" ")
            if name != START_TIME_SERIES:
                continue
            try:
                seconds = float(value.split(" ")[0])
            except ValueError:
                return None
            return seconds if math.isfinite(seconds) and seconds > 0 else None
    return None
