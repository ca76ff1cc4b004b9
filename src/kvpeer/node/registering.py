"""Frames held while a peer registers off the node's lock (peer table invariant 9).

A peer whose ``connect`` the data plane registers slowly (a NIXL metadata load,
an shm region request) has that frame and every later one held here, in order,
bounded (:data:`MAX_HELD_FRAMES` frames, ``max_bytes`` bytes; the rest are
dropped), until the registration is ready or ``timeout_s`` passed. Decoded
once: each frame is kept with its message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvpeer.protocol import Inbound
from kvpeer.transport.base import InboundFrame

__all__ = ["MAX_HELD_FRAMES", "HeldFrames", "Released"]

#: Frames of one peer held while its registration runs off the lock.
MAX_HELD_FRAMES = 64

Held = list[tuple[InboundFrame, Inbound]]
#: A peer whose holding ended: its frames, and whether its registration timed out.
Released = tuple[str, Held, bool]


class HeldFrames:
    """Per peer registering off the lock: since when, and its frames in order."""

    def __init__(self, max_bytes: int, timeout_s: float) -> None:
        self._max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._held: dict[str, tuple[float, Held]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def holds(self, peer_id: str) -> bool:
        return peer_id in self._held

    def start(self, peer_id: str, inbound: InboundFrame, message: Inbound, now: float) -> None:
        """``inbound`` (a connect) waits for its peer's registration."""
        self._held[peer_id] = (now, [(inbound, message)])

    def add(self, peer_id: str, inbound: InboundFrame, message: Inbound) -> bool:
        """Hold a later frame of a peer that registers; False: over the bounds, dropped."""
        frames = self._held[peer_id][1]
        size = sum(len(f.frame) for f, _ in frames) + len(inbound.frame)
        if len(frames) < MAX_HELD_FRAMES and size <= self._max_bytes:
            frames.append((inbound, message))
            return True
        return False

    def deadlines(self) -> Iterator[float]:
        return (since + self._timeout_s for since, _ in self._held.values())

    def release(self, now: float, preparing: Callable[[str], bool]) -> Iterator[Released]:
        """The peers whose registration is ready (or timed out), each forgotten here
        before it is yielded: its frames are routed anew."""
        for peer_id, (since, frames) in list(self._held.items()):
            still = preparing(peer_id)
            if still and now < since + self._timeout_s:
                continue
            del self._held[peer_id]
            yield peer_id, frames, still
