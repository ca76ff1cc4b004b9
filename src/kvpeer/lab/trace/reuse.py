"""How much of a trace any cache could save: reuse with an infinite shared cache.

A block id seen before in the trace is a reuse: with one cache that never forgets,
shared by every engine, that block is never computed again. Because a trace's ids are
prefix hashes (an id names its block and everything before it), a reused id's whole
prefix was seen too, so counting ids is counting reusable prefix blocks. This is the
physical limit of any placement and any tier on that trace.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpeer.lab.trace.mooncake import TraceRequest

__all__ = ["Reuse", "infinite_cache_reuse"]


@dataclass(frozen=True, slots=True)
class Reuse:
    blocks: int  # block ids over every request
    reused: int  # of those, ids some earlier request had

    @property
    def fraction(self) -> float:
        return self.reused / self.blocks if self.blocks else 0.0


def infinite_cache_reuse(requests: Iterable[TraceRequest], *, full_only: bool = False) -> Reuse:
    """Reuse of ``requests`` in order with an infinite cache (module docstring).

    ``full_only``: count only each prompt's full blocks (a prefix cache never holds a
    partial one); the trace's own figures count every id."""
    seen: set[int] = set()
    blocks = reused = 0
    for request in requests:
        ids = request.full_blocks if full_only else request.hash_ids
        blocks += len(ids)
        reused += sum(1 for block in ids if block in seen)
        seen.update(ids)
    return Reuse(blocks, reused)
