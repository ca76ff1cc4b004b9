"""Which sources the engine's scheduler may still wait for, inside a lookup, for a pull.

kvpeer's tiering manager (``kvpeer.integrations.vllm.manager``) lets the scheduler's
thread wait up to ``sync_pull_wait_s`` for a pull it submitted at once. A source that
made it wait in vain :data:`SLOW_PULL_MISSES` times in a row (a session's first pull
may still map memory: one miss is forgiven) is not waited for again for
:data:`SLOW_PULL_BACKOFF_S`; a pull that lands clears its record at once.

Invariants:

1. A slow or hostile peer costs the scheduler at most :data:`SLOW_PULL_MISSES` bounded
   waits per :data:`SLOW_PULL_BACKOFF_S`, not one per request.
2. At most ``limit`` peers are remembered: a new one first drops the expired records,
   then the one whose back-off ends first.
"""

from __future__ import annotations

from typing import Final

__all__ = ["SLOW_PULL_BACKOFF_S", "SLOW_PULL_MISSES", "PullWaits"]

SLOW_PULL_MISSES: Final = 2
SLOW_PULL_BACKOFF_S: Final = 10.0


class PullWaits:
    """Per source: waits in vain in a row, and until when it is not waited for."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._peers: dict[str, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def allowed(self, peer_id: str, now: float) -> bool:
        return self._peers.get(peer_id, (0, 0.0))[1] <= now

    def landed(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)

    def missed(self, peer_id: str, now: float) -> None:
        peers = self._peers
        if peer_id not in peers and len(peers) >= self._limit:
            peers = self._peers = {p: w for p, w in peers.items() if w[1] > now}  # expired
            if len(peers) >= self._limit:
                del peers[min(peers, key=lambda p: peers[p][1])]  # the one that ends first
        misses = peers.get(peer_id, (0, 0.0))[0] + 1
        peers[peer_id] = (misses, now + SLOW_PULL_BACKOFF_S if misses >= SLOW_PULL_MISSES else 0.0)
