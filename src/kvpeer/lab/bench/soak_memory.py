"""``kvpeer soak --trace-memory``: where the driver's memory grew during the soak.

The soak judges the driver (its traffic threads and both routers) by private RSS after
warm-up and at the end. When that grows, this says where: with ``tracemalloc`` on from
the start, the allocations live at the first sample are compared with those live at the
second, grouped by the allocating call stack, largest growth first. Off by default:
tracing every allocation slows the driver down.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MemoryTrace"]

#: Frames kept per allocation: enough to see which of our calls made a library allocate.
FRAMES = 8
#: Stacks reported, largest growth first.
TOP = 12


@dataclass
class MemoryTrace:
    """Marks the first sample and compares the second with it (both no-ops when off)."""

    enabled: bool = False
    growth: list[dict[str, Any]] = field(default_factory=list)
    _first: tracemalloc.Snapshot | None = None

    def start(self) -> None:
        if self.enabled and not tracemalloc.is_tracing():
            tracemalloc.start(FRAMES)

    def mark(self) -> None:
        if self.enabled:
            self._first = _snapshot()

    def compare(self, progress: Callable[[str], None]) -> None:
        if self._first is None:
            return
        stats = _snapshot().compare_to(self._first, "traceback")
        grown = sorted((s for s in stats if s.size_diff > 0), key=lambda s: -s.size_diff)
        total = sum(s.size_diff for s in stats)
        progress(f"driver allocations, second sample less first: {total / 2**20:+.2f} MiB")
        for stat in grown[:TOP]:
            frames = [f"{frame.filename}:{frame.lineno}" for frame in stat.traceback]
            self.growth.append(
                {"bytes": stat.size_diff, "blocks": stat.count_diff, "stack": frames}
            )
            progress(
                f"  {stat.size_diff / 2**10:+.0f} KiB in {stat.count_diff:+d} blocks at "
                + " <- ".join(reversed(frames[-3:]))
            )
        tracemalloc.stop()


def _snapshot() -> tracemalloc.Snapshot:
    return tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )


#: The router gauges that say how much its prefix index holds.
INDEX_GAUGES = ("kvpeer_router_index_blocks", "kvpeer_router_index_hash_mappings")


def router_index(metrics_url: str, timeout_s: float = 5.0) -> dict[str, int]:
    """What a router's prefix index holds, from its ``/metrics``: ``{"a GPU": blocks,
    "a CPU": blocks, "a mappings": hash mappings, ...}`` (empty if it did not answer)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as answer:
            text = answer.read().decode()
    except OSError:
        return {}
    held: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in INDEX_GAUGES:
            continue
        for sample in family.samples:
            what = sample.labels.get("medium", "mappings")
            held[f"{sample.labels.get('engine', '?')} {what}"] = int(sample.value)
    return held
