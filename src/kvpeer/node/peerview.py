"""The peers as an operator sees them (``kvpeer stats``, the ``/peers`` JSON)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kvpeer.node.peermemory import PeerMemory
from kvpeer.session import PeerSession

__all__ = ["PeerView", "ViewedPeer", "peer_views"]


class ViewedPeer(Protocol):
    """What a view reads of a peer table's entry (:class:`kvpeer.node.peertable.Peer`):
    the peer table imports this module, never the other way round."""

    @property
    def session(self) -> PeerSession: ...

    @property
    def opened_at(self) -> float: ...

    @property
    def last_heard(self) -> float | None: ...

    @property
    def blocks_pulled(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PeerView:
    """One peer as an operator sees it (``kvpeer stats``); times are seconds before now.

    ``state`` is ``handshake``, ``ready``, ``closed`` (ended, not reaped yet) or
    ``backed_off`` (no session: unreachable a moment ago, retried in ``retry_in_s``)."""

    peer_id: str
    state: str
    age_s: float | None
    silent_s: float | None  # since the peer's last frame (None: never heard)
    consumer_requests: int  # our requests pulling from it
    producer_requests: int  # its requests we serve
    loads_in_flight: int
    lookups_waiting: int  # keys we probed, waiting for its answer
    lookups_queued: int  # keys it looked up, waiting for our engine
    transfers_in_flight: int
    blocks_pulled: int
    blocks_served: int
    retry_in_s: float | None


def peer_views(
    peers: Mapping[str, ViewedPeer], memory: PeerMemory, now: float, limit: int
) -> tuple[list[PeerView], int]:
    """At most ``limit`` peers (sessions, then backed-off peers without one, each by
    peer id) and how many there are in all."""
    views: list[PeerView] = []
    backed_off = sorted(p for p in memory.backed_off_peers() if p not in peers)
    total = len(peers) + len(backed_off)
    for peer_id in sorted(peers)[:limit]:
        peer = peers[peer_id]
        session = peer.session
        stats = session.statistics()
        state = "closed" if stats.closed else "ready" if stats.ready else "handshake"
        retry_at = memory.retry_at(peer_id)
        views.append(
            PeerView(
                peer_id=peer_id,
                state=state,
                age_s=now - peer.opened_at,
                silent_s=None if peer.last_heard is None else now - peer.last_heard,
                consumer_requests=stats.consumer.requests,
                producer_requests=stats.producer.requests,
                loads_in_flight=stats.consumer.loads_in_flight,
                lookups_waiting=stats.consumer.probes_waiting,
                lookups_queued=stats.producer.lookups_queued,
                transfers_in_flight=stats.producer.transfers_in_flight,
                blocks_pulled=peer.blocks_pulled,
                blocks_served=stats.producer.blocks_written,
                retry_in_s=None if retry_at is None else max(0.0, retry_at - now),
            )
        )
    for peer_id in backed_off:
        if len(views) >= limit:
            break
        until = memory.retry_at(peer_id)
        assert until is not None
        idle = (0,) * 8  # no session: no requests, work or blocks
        views.append(PeerView(peer_id, "backed_off", None, None, *idle, max(0.0, until - now)))
    return views, total
