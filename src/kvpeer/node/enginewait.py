"""How long a peer's lookup waits for the engine: ``engine_wait_s``, from the engine's steps.

A peer's lookup (a resolve fetch's included) that held blocks cannot answer waits for
the engine's next serve window, which comes once per engine step. An engine in a long
prefill step serves it only when that step ends: measured on the ladder, a pull ahead
from a busy producer whose held copy had been evicted waited 4.3 s for a step, where
computing the prompt took 1.9 s. A peer gains nothing from a wait longer than computing.

So the tier tells its sessions (:class:`kvpeer.session.ports.EngineSteps`) when such a
lookup is answered without the engine (producer invariant 10), from what it sees of the
engine's steps: the time of its last serve window (``on_schedule_end``) and whether the
engine has requests open (``on_new_request`` .. ``on_request_finished``).

- Engine with requests open (stepping): a step that began at ``anchor`` (its window, or
  the moment the engine got its first request) is waited for until ``anchor + wait``; a
  lookup arriving later than that is answered at once. So no lookup waits past a step
  that has run longer than ``wait``, and one arriving mid-way through a short step
  waits for it.
- Engine idle: it steps as soon as the tier has work (it reports pending work), so a
  lookup waits ``wait`` from its arrival.

``wait`` None: every lookup waits for a window (bounded only by
``lookup_pending_timeout_s``), as before this rule. Nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["EngineWindows"]


class EngineWindows:
    """The engine's serve windows as the tier sees them; a :class:`EngineSteps`."""

    def __init__(self, wait_s: float | None, stepping: Callable[[], bool]) -> None:
        """``stepping``: whether the engine has requests open now."""
        self._wait = wait_s
        self._stepping = stepping
        self._anchor: float | None = None  # the current step's start, if stepping
        self.windows = 0

    def window(self, now: float) -> None:
        """The engine's serve window ran at ``now``: its next step starts."""
        self._anchor = now
        self.windows += 1

    def opened(self, now: float, first: bool) -> None:
        """A request was opened; ``first``: the engine had none open before."""
        if first:
            self._anchor = now  # an idle engine wakes and steps from now

    def answer_by(self, received_at: float) -> float | None:
        wait = self._wait
        if wait is None:
            return None
        anchor = self._anchor
        if anchor is None or not self._stepping():
            return received_at + wait
        return max(received_at, anchor + wait)
