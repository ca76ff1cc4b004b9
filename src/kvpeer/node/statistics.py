"""What a tier holds now (:class:`TierStatistics`), gathered from its parts.

Sizes are read at the call; the fields marked "since start" only grow. Read under
the node's lock, like every part it gathers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvpeer.node.bindings import BindingStatistics
from kvpeer.node.held import HeldStatistics
from kvpeer.node.peertable import PeerTableStatistics
from kvpeer.node.requests import OpenRequests
from kvpeer.session import SessionStatistics

__all__ = ["TierStatistics", "gather"]


@dataclass(frozen=True, slots=True)
class TierStatistics:
    sessions: int
    requests: int
    consumer_ids: int
    producer_ids: int
    failed_ids: int
    bound_ids: int
    parked_ids: int
    parked_batches: int
    tombstones: int
    early_fetches: int
    loads_in_flight: int
    transfers_in_flight: int
    pinned_blocks: int
    results_pending: int
    peers_refused: int
    #: since start: frames of ended sessions, dropped (from a peer without a live
    #: session, or into a session they cannot belong to: session invariant 7)
    stray_frames: int
    blocks_loaded: int  # since start: blocks successful loads brought from peers
    #: since start: sessions ended, by :class:`CloseKind` value
    sessions_ended: dict[str, int] = field(default_factory=dict)
    held_blocks: int = 0  # blocks held now (kvpeer.node.held)
    held_bytes: int = 0
    staged_blocks: int = 0  # pulled ahead, waiting for their request (kvpeer.node.ahead)
    staging_free: int = 0  # staging rows free now


def gather(
    *,
    live: Iterable[SessionStatistics],
    retired_stale_frames: int,
    table: PeerTableStatistics,
    bindings: BindingStatistics,
    held: HeldStatistics | None,
    staging: tuple[int, int, int],
    requests: OpenRequests,
    results_pending: int,
    blocks_loaded: int,
    ended: Mapping[str, int],
) -> TierStatistics:
    """The tier's statistics from its parts' (``staging``:
    :meth:`kvpeer.node.ahead.PullAhead.statistics`)."""
    loads = transfers = pins = 0
    stale = retired_stale_frames
    for stats in live:
        stale += stats.stale_frames
        loads += stats.consumer.loads_in_flight
        transfers += stats.producer.transfers_in_flight
        pins += stats.producer.pinned_blocks
    staged, _, staging_free = staging
    return TierStatistics(
        sessions=table.sessions,
        requests=len(requests),
        consumer_ids=requests.consumer_ids,
        producer_ids=bindings.producer_ids,
        failed_ids=requests.failed_ids,
        bound_ids=bindings.bound_ids,
        parked_ids=bindings.parked_ids,
        parked_batches=bindings.parked_batches,
        tombstones=bindings.tombstones,
        early_fetches=bindings.early_fetches,
        loads_in_flight=loads,
        transfers_in_flight=transfers,
        pinned_blocks=pins,
        results_pending=results_pending,
        peers_refused=table.peers_refused,
        stray_frames=table.stray_frames + stale,
        blocks_loaded=blocks_loaded,
        sessions_ended=dict(ended),
        held_blocks=held.blocks if held is not None else 0,
        held_bytes=held.bytes if held is not None else 0,
        staged_blocks=staged,
        staging_free=staging_free,
    )
