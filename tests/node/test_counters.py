"""What tells a metrics reader that the node counted something (``TierCounters.activity``).

vLLM's ``get_stats`` reads the node only when ``activity`` moved (or a second later,
at some later step): anything counted without moving it reaches ``/metrics`` late, and
never if it was counted in the engine's last step before an idle spell.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpeer.node.counters import AHEAD_EVENTS, PULL_WAIT_OUTCOMES, EventCounter, TierCounters


def _pull_wait(outcome: str) -> Callable[[TierCounters], None]:
    def count(c: TierCounters) -> None:
        c.pull_waits[outcome] += 1  # as the tier counts them: through the item
        c.pull_wait_seconds.observe(0.01)

    return count


def _ahead(event: str) -> Callable[[TierCounters], None]:
    def count(c: TierCounters) -> None:
        c.ahead[event] += 1

    return count


def _timeout(c: TierCounters) -> None:
    c.timeouts["unbound_store"] += 1


COUNTED: dict[str, Callable[[TierCounters], None]] = {
    "load ok": lambda c: setattr(c, "loads_ok", c.loads_ok + 1),
    "load failed": lambda c: setattr(c, "loads_failed", c.loads_failed + 1),
    "session opened": lambda c: setattr(c, "sessions_opened", c.sessions_opened + 1),
    "lookup": lambda c: c.lookup_seconds.observe(0.001),
    "tier timeout": _timeout,
    "peer waited for a step": lambda c: c.step_wait_seconds.observe(0.02),
    **{f"pull wait {outcome}": _pull_wait(outcome) for outcome in PULL_WAIT_OUTCOMES},
    **{f"ahead {event}": _ahead(event) for event in AHEAD_EVENTS},
}


@pytest.mark.parametrize("what", COUNTED)
def test_everything_counted_moves_the_activity(what: str) -> None:
    counters = TierCounters()
    before = counters.activity()
    COUNTED[what](counters)
    assert counters.activity() > before


def test_an_event_counter_counts_its_updates_not_its_totals() -> None:
    counter = EventCounter()
    counter["a"] += 5
    counter["b"] += 1
    counter["a"] += 0  # counted again: a write is a write
    assert (dict(counter), counter.changes) == ({"a": 5, "b": 1}, 3)
