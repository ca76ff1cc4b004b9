"""How often each source's tier really answers peers from held blocks.

A tier with held blocks (``held_bytes``) answers a peer's lookup on its node's thread
only when every key is in its held copy, which is at most a quarter of the CPU tier;
any other lookup waits for the engine's next serve window, as on a tier without held
blocks. The tier counts both on its ``/metrics``
(``vllm:kvpeer_peer_lookups_total{path="held"|"engine"}``, a resolve fetch's lookup
included), and the router, which scrapes that page for load already
(:mod:`kvpeer.router.engineload`), keeps per engine the share answered held: the cost
model weights a busy source's serve wait by the rest (docs/router.md).

Rules:

1. The share moves only with lookups counted between two scrapes: each lookup weighs
   :data:`ALPHA` (the share after ``n`` new lookups, ``h`` of them held, is
   ``f + (1 - (1 - ALPHA) ** n) * (h / n - f)``). An idle source keeps its share.
2. Until a source has reported lookups its share is :data:`UNKNOWN` (1.0: the operator
   said ``held = true``, and a tier that does not export the counter is quoted as
   before). A tier that exports it moves off the prior within a few lookups, and only
   a busy source's quote depends on it.
3. Counts are since the tier started; the first report's are all new (a router started
   late learns the tier's history at once), and so is a count below the last one (an
   engine restart: the counter started over from zero), as Prometheus' ``rate`` reads
   a reset.
4. Every value is hostile until checked: a count must be a finite number within
   ``0..MAX_COUNT`` (here and where the page is read,
   :func:`kvpeer.router.engineload.parse_peer_lookups`), else the pair is ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ALPHA", "MAX_COUNT", "UNKNOWN", "HeldShare"]

ALPHA = 0.125  # weight of one lookup: the share follows the last ~8
UNKNOWN = 1.0
MAX_COUNT = float(2**53)  # a counter past this has lost integer precision: not a count


@dataclass(slots=True)
class _Source:
    held: float = 0.0  # the counts at the last scrape (the baseline)
    engine: float = 0.0
    share: float = UNKNOWN
    lookups: float = 0.0  # since this router started, resets excluded


class HeldShare:
    """Per source, the smoothed share of its peers' lookups answered from held blocks."""

    def __init__(self) -> None:
        self._sources: dict[str, _Source] = {}

    def share(self, name: str) -> float:
        """``name``'s share (rule 2: :data:`UNKNOWN` until it reported lookups)."""
        source = self._sources.get(name)
        return UNKNOWN if source is None else source.share

    def observe(self, name: str, held: float, engine: float) -> None:
        """``name``'s tier reported these since-start counts (rules 1, 3 and 4)."""
        if not all(math.isfinite(v) and 0.0 <= v <= MAX_COUNT for v in (held, engine)):
            return
        source = self._sources.setdefault(name, _Source())
        new_held, new_engine = held - source.held, engine - source.engine
        if new_held < 0 or new_engine < 0:  # a reset: counted from zero again
            new_held, new_engine = held, engine
        source.held, source.engine = held, engine
        lookups = new_held + new_engine
        if lookups <= 0:
            return
        weight = 1.0 - (1.0 - ALPHA) ** lookups
        source.share += weight * (new_held / lookups - source.share)
        source.share = min(1.0, max(0.0, source.share))
        source.lookups += lookups

    def statistics(self) -> Mapping[str, float]:
        """``share:<name>`` and ``lookups:<name>`` of every source that reported."""
        out: dict[str, float] = {}
        for name, source in sorted(self._sources.items()):
            out[f"share:{name}"] = source.share
            out[f"lookups:{name}"] = source.lookups
        return out
