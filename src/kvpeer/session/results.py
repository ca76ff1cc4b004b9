"""Values the session core hands back to its owner (results are past tense)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpeer.types import ServeRequest

__all__ = [
    "CloseKind",
    "LoadFinished",
    "PollResult",
    "SessionClosed",
    "StoreFinished",
]


@dataclass(frozen=True, slots=True)
class LoadFinished:
    """A load job (peer -> our primary) ended; reported exactly once per job.

    ``blocks``: how many blocks it brought and ``seconds`` how long that took from
    the fetch (both 0 unless it succeeded)."""

    job_id: int
    kv_request_id: str
    success: bool
    reason: str = ""
    blocks: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class StoreFinished:
    """A store job (our pinned slots served to the peer) ended; exactly once."""

    job_id: int
    success: bool
    reason: str = ""


class CloseKind(enum.Enum):
    """Why a session ended."""

    LOCAL = "local"  # our owner closed it
    DISCONNECTED = "disconnected"  # the peer said goodbye
    PROTOCOL_ERROR = "protocol_error"  # the peer (or we) broke the protocol
    REJECTED = "rejected"  # handshake check failed (either side)
    TIMEOUT = "timeout"  # handshake deadline passed
    RESTARTED = "restarted"  # the peer came back with a new boot id
    RENEWED = "renewed"  # the peer began its next session (same boot id; peer.py invariant 3)
    UNREACHABLE = "unreachable"  # the control link could not carry our frames
    PEER_FAULT = "peer_fault"  # the peer's data-plane parameters or writes were unusable
    LOCAL_FAULT = "local_fault"  # our own data plane failed (not the peer's doing)
    OVER_BUDGET = "over_budget"  # the peer made us hold more than its budget
    INTERNAL_ERROR = "internal_error"  # a bug of ours met the peer's input (logged)


@dataclass(frozen=True, slots=True)
class SessionClosed:
    """Everything the owner must settle for a session that ended.

    ``loads``/``stores`` are failed results for every job the session held;
    ``failed_request_ids`` are consumer ids whose lookups can no longer
    resolve (in-flight loads or unresolved probes; for ``RENEWED``, every id
    the session held consumer state for): answer MISS for them;
    ``unreleased_serves`` still owe ``parent.on_request_finished``.
    """

    kind: CloseKind
    reason: str
    loads: tuple[LoadFinished, ...] = ()
    stores: tuple[StoreFinished, ...] = ()
    failed_request_ids: tuple[str, ...] = ()
    unreleased_serves: tuple[ServeRequest, ...] = ()
    #: The exception that ended it, for ``INTERNAL_ERROR`` and ``LOCAL_FAULT`` (to log).
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class PollResult:
    """What happened since the last poll.

    ``fetched_ids``: ids a peer fetched in a round without lookup state (PD
    demand: the owner binds the id's parked stores to this session);
    ``prefilled_ids``: those of them whose fetch said the producer's prefill leg
    already answered (``Fetch.prefill_done``). ``expired_probe_ids``:
    consumer ids whose probes went unanswered past the lookup timeout (their
    probes now answer MISS). ``closed`` is set once, on the poll after the
    session ended; its failed jobs are not repeated in ``loads``/``stores``.
    """

    loads: tuple[LoadFinished, ...] = ()
    stores: tuple[StoreFinished, ...] = ()
    fetched_ids: tuple[str, ...] = ()
    prefilled_ids: tuple[str, ...] = ()
    expired_probe_ids: tuple[str, ...] = ()
    closed: SessionClosed | None = field(default=None)
    #: how long each answered consumer lookup waited (probe registered -> answer)
    lookup_seconds: tuple[float, ...] = ()

    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.stores
            or self.fetched_ids
            or self.expired_probe_ids
            or self.closed
            or self.lookup_seconds
        )
