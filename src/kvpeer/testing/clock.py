"""A clock that moves only when a test says so."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """Monotonic fake time in seconds; call it or read :attr:`now`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds}s)")
        self.now += seconds
        return self.now
