"""What the peer table remembers of peers beyond their sessions; every memory bounded.

Three memories, each keyed by peer id, oldest first, the oldest forgotten first
(the rules are :mod:`kvpeer.node.peertable`'s invariants):

- connects it refused, for ``handshake_timeout_s`` (invariant 3; at most
  ``max_peers``): two connects are the same but for the session number a
  kvpeer peer's every new session raises;
- peers backed off after they could not be reached (invariant 7; at most
  ``4 * max_peers``): no new session before the retry time, which doubles from
  :data:`FIRST_RETRY_S` up to ``peer_retry_max_s``;
- when each peer's last session ended (invariant 1; at most ``4 * max_peers``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator

import msgspec

from kvpeer.config import TierConfig
from kvpeer.protocol import Connect

__all__ = ["FIRST_RETRY_S", "PeerMemory"]

log = logging.getLogger("kvpeer.tier")  # the tier's log: operators grep one name

#: The first back-off after a peer could not be reached (invariant 7).
FIRST_RETRY_S = 1.0


class PeerMemory:
    """Refused connects, back-offs and session endings, by peer."""

    def __init__(self, config: TierConfig) -> None:
        self._config = config
        # peer -> (digest of the connect we refused, when that stops counting, why)
        self._refused_hellos: dict[str, tuple[bytes, float, str]] = {}
        # peer -> (no new session before this time, the back-off that set it)
        self._backoff: dict[str, tuple[float, float]] = {}
        # peer -> when its last session ended
        self._ended_at: dict[str, float] = {}

    # -- refused connects (invariant 3) -----------------------------------------------

    def refused_before(self, peer_id: str, hello: Connect, frame: bytes, now: float) -> str | None:
        """Why ``hello`` (decoded from ``frame``) was refused a moment ago, if it was."""
        refused = self._refused_hellos.get(peer_id)
        if refused is None:
            return None
        digest, expiry, reason = refused
        return reason if digest == _hello_digest(hello, frame) and now < expiry else None

    def remember_refusal(
        self, peer_id: str, hello: Connect, frame: bytes, reason: str, now: float
    ) -> None:
        """``hello`` (decoded from ``frame``) made us refuse ``peer_id``."""
        self._refused_hellos.pop(peer_id, None)
        expiry = now + self._config.handshake_timeout_s
        self._refused_hellos[peer_id] = (_hello_digest(hello, frame), expiry, reason)
        while len(self._refused_hellos) > self._config.max_peers:
            del self._refused_hellos[next(iter(self._refused_hellos))]

    def expire(self, now: float) -> None:
        """Forget refused connects whose time is up."""
        while self._refused_hellos:  # in expiry order: one timeout for all of them
            peer_id, (_, expiry, _) = next(iter(self._refused_hellos.items()))
            if now < expiry:
                break
            del self._refused_hellos[peer_id]

    @property
    def refusals(self) -> int:
        return len(self._refused_hellos)

    # -- back-off (invariant 7) ----------------------------------------------------------

    def backed_off(self, peer_id: str, now: float, *, answered: bool) -> bool:
        """No new session toward ``peer_id`` yet; ``answered``: a session of it
        completed our half of the handshake since (the back-off is cleared)."""
        entry = self._backoff.get(peer_id)
        if entry is None:
            return False
        if answered:
            del self._backoff[peer_id]  # it came back
            return False
        return now < entry[0]

    def back_off(self, peer_id: str, now: float) -> None:
        previous = self._backoff.pop(peer_id, None)
        delay = FIRST_RETRY_S if previous is None else previous[1] * 2
        delay = min(delay, self._config.peer_retry_max_s)
        self._backoff[peer_id] = (now + delay, delay)
        log.info("peer %s unreachable: no new session toward it for %gs", peer_id, delay)
        while len(self._backoff) > 4 * self._config.max_peers:  # bounded, oldest first
            del self._backoff[next(iter(self._backoff))]

    def retry_at(self, peer_id: str) -> float | None:
        """When ``peer_id``'s back-off ends (None: not backed off)."""
        entry = self._backoff.get(peer_id)
        return None if entry is None else entry[0]

    def backed_off_peers(self) -> Iterator[str]:
        return iter(self._backoff)

    @property
    def backoffs(self) -> int:
        return len(self._backoff)

    # -- session endings (invariant 1) --------------------------------------------------

    def session_ended(self, peer_id: str, now: float) -> None:
        self._ended_at.pop(peer_id, None)
        self._ended_at[peer_id] = now
        while len(self._ended_at) > 4 * self._config.max_peers:  # bounded
            del self._ended_at[next(iter(self._ended_at))]

    def ended_at(self, peer_id: str) -> float | None:
        """When ``peer_id``'s last session ended, if that is remembered."""
        return self._ended_at.get(peer_id)


def _hello_digest(hello: Connect, frame: bytes) -> bytes:
    """What makes two connects (``hello``, decoded from ``frame``) the same: all but
    the session number, which a kvpeer peer's every new session raises."""
    if hello.kvpeer is not None:
        unnumbered = msgspec.structs.replace(hello.kvpeer, session=None)
        frame = msgspec.msgpack.encode(msgspec.structs.replace(hello, kvpeer=unnumbered))
    return hashlib.blake2b(frame, digest_size=16).digest()
