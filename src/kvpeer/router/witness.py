"""The edge's :class:`~kvpeer.router.health.ProcessWitness`: an engine's KV-event feed.

When an engine's health check fails, the witness keeps the feed's :class:`Anchor` (the
last batch applied before the engine went down). When the check passes again, the
subscriber asks the engine's replay endpoint for every batch from the anchor's ``seq``:
the same process replays that very batch, byte for byte (feed invariant 5). Only that
proves a flap; everything else counts as a restart, as before:

- an engine without an event feed, or without a replay endpoint: nothing to ask;
- nothing applied before it went down (no anchor): nothing to compare;
- a publisher that holds other bytes at that ``seq``, nothing from it on, or whose
  ``seq`` went back (a new process, even one that already counted past the old
  position: a forward gap that ``seq`` alone would have taken for lost events);
- a buffer that no longer reaches back to the anchor, a replay already under way.

Why not HTTP: ``vllm serve`` exposes no process identity on ``/health`` or
``/version``; ``/metrics`` carries ``process_start_time_seconds`` of the API server only
with a single API server (``--api-server-count`` > 1 switches to prometheus'
multiprocess registry, which has none), and the API server is not the process that
holds the cache (the engine core is). The event stream is published by the engine core
itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpeer.router.feed import Anchor, Continuity
from kvpeer.router.subscriber import EventSubscriber

__all__ = ["FeedWitness"]


class FeedWitness:
    """Proves a returning engine unchanged through its event feed (see the module doc)."""

    def __init__(self, subscribers: Mapping[str, EventSubscriber]) -> None:
        self._subscribers = subscribers
        self._anchors: dict[str, Anchor | None] = {}

    def went_down(self, name: str) -> None:
        subscriber = self._subscribers.get(name)
        self._anchors[name] = subscriber.anchor() if subscriber is not None else None

    async def same_process(self, name: str) -> bool:
        subscriber = self._subscribers.get(name)
        anchor = self._anchors.pop(name, None)
        if subscriber is None:
            return False  # no event feed: nothing can prove it (restart, as before)
        return await subscriber.verify(anchor) is Continuity.SAME
