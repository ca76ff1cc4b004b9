"""Timeouts and bounds of one peer session (the tier builds these from config)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SessionSettings"]


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """Every duration is in seconds of the caller's clock.

    ``load_timeout_s``: consumer, fetch without completion -> abort_fetch.
    ``abort_ack_timeout_s``: consumer, abort without ack -> load fails anyway.
    ``lookup_timeout_s``: consumer, unanswered probe -> MISS.
    ``lookup_pending_timeout_s``: producer, HIT_PENDING/RETRY key -> MISS.
    ``store_timeout_s``: producer, pinned supply nobody fetched -> unpinned.
    ``abort_drain_timeout_s``: producer, in-flight writes of an aborted or
    failed round get this long to stop before they are abandoned.
    ``transfer_timeout_s``: producer, a write still running this long fails its
    round (by then the consumer's load timed out and its abort went unanswered).
    ``handshake_timeout_s``: connected but not acknowledged -> dead.
    ``peer_wait_s``: how long a request waits on a peer from which nothing at all
    has come (not even its ``connect``; after the handshake, not even an answer to
    our pings) before the session is given up as unreachable; the session itself
    would wait ``handshake_timeout_s`` or the transport's heartbeat. 1.5 s: the
    engine sees the failed load at its next step, so a request falls back within
    the 2 s budget of issue 11 with half a second left for that step.
    ``max_queued_messages``: messages held until the peer's ack; more ends
    the session.
    ``max_peer_bytes``: what one peer may make us hold (queued lookups, parked
    demand, per-request state); more ends the session. One lookup's keys may take
    at most a sixteenth of it: its answer echoes them, and the control transport
    holds a few answers a peer does not read before it notices (see
    ``kvpeer.transport.zmq_control``, rule 2).
    """

    load_timeout_s: float = 30.0
    abort_ack_timeout_s: float = 12.0
    lookup_timeout_s: float = 30.0
    lookup_pending_timeout_s: float = 5.0
    store_timeout_s: float = 30.0
    abort_drain_timeout_s: float = 3.0
    transfer_timeout_s: float = 42.0
    handshake_timeout_s: float = 30.0
    peer_wait_s: float = 1.5
    max_queued_messages: int = 4096
    max_peer_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"SessionSettings.{name} must be > 0, got {value!r}")
