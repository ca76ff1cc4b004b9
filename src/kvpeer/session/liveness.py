"""Whether a peer a request waits on is still there: its silence, and a ping first. Sans-IO.

The rule is the session's invariant 4 (``kvpeer.session.peer``): once a load
or probe waits and nothing at all came from the peer within ``peer_wait_s`` of
the session's start, it is given up. A peer that spoke and then went quiet
(frozen, partitioned) is pinged after ``peer_wait_s / 4`` of silence - counted
from its last frame, or from when our requests began to wait if that is later -
if it answers pings (a kvpeer peer of version >= ``PING_VERSION``), and given up
after ``peer_wait_s``. A quiet peer nobody waits on is never pinged; one that
cannot answer pings is left to the transport's heartbeat once it has spoken.
Stragglers (session invariant 7) are not heard from the peer.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Liveness", "Silence"]


class Silence(NamedTuple):
    """While a request waits: when to give the peer up, and when to ping it first
    (None: no ping due)."""

    give_up_at: float
    ping_at: float | None


class Liveness:
    """When the peer was last heard, when our requests began waiting, our ping."""

    __slots__ = ("_heard_at", "_ping_out", "_wait_began", "_wait_s", "pings")

    def __init__(self, peer_wait_s: float) -> None:
        self._wait_s = peer_wait_s
        self._heard_at: float | None = None
        self._wait_began = 0.0
        self._ping_out = False  # a ping of ours that nothing came after yet
        self.pings = 0

    @property
    def heard(self) -> bool:
        """Anything (but stragglers) came from the peer."""
        return self._heard_at is not None

    def heard_at(self, now: float) -> None:
        """A frame of this session came from the peer."""
        self._heard_at = now
        self._ping_out = False

    def wait_begins(self, now: float) -> None:
        """A load or probe waits where none did: the quiet clock starts now."""
        self._wait_began = now
        self._ping_out = False

    def pinged(self) -> None:
        self._ping_out = True
        self.pings += 1

    def silence(self, started_at: float, answers_pings: bool, answered: bool) -> Silence | None:
        """While a request waits on the peer (the caller asks only then): when to
        give it up, and when to ping it. ``answers_pings``: the peer's version
        answers pings; ``answered``: it acknowledged our connect."""
        wait = self._wait_s
        if self._heard_at is None:
            return Silence(started_at + wait, None)
        if not answers_pings:
            return None  # it cannot be asked: the transport's heartbeat decides
        quiet_from = max(self._heard_at, self._wait_began)
        ping_due = answered and not self._ping_out
        return Silence(quiet_from + wait, quiet_from + wait / 4 if ping_due else None)
