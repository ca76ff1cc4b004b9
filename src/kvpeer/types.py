"""Vocabulary shared by the session core, the tier and the hosts. Pure data."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = [
    "JobResult",
    "Key",
    "LookupResult",
    "OffloadPolicy",
    "RequestContext",
    "ServeRequest",
    "StoreJob",
    "TransferJob",
]

#: A block key: chained prefix hash + 4-byte big-endian KV-cache group index.
Key: TypeAlias = bytes


class LookupResult(enum.Enum):
    """Answer of a tier (or the host's parent) for one key."""

    HIT = "hit"  # present and readable now
    HIT_PENDING = "hit_pending"  # present, not readable yet
    RETRY = "retry"  # not decided; ask again next step
    MISS = "miss"  # absent


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """A synthetic request through which a peer's lookup is served by the parent.

    One exists per inbound ``lookup`` message; the parent sees
    ``on_new_request`` once and ``on_request_finished`` exactly once for it.
    """

    req_id: str
    kv_request_id: str
    peer_id: str


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Primary slots the parent pinned for ``keys``, released by the job's result."""

    job_id: int
    keys: tuple[Key, ...]
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.slots):
            raise ValueError(
                f"store job {self.job_id}: {len(self.keys)} keys but {len(self.slots)} slots"
            )


class OffloadPolicy(enum.Enum):
    """What a tier wants stored for a request."""

    CHUNK_LEVEL = "chunk_level"  # only newly computed blocks
    REQUEST_LEVEL = "request_level"  # every block, including ones already in the primary


@dataclass(frozen=True, slots=True)
class RequestContext:
    """An engine request as the tier sees it."""

    req_id: str
    kv_transfer_params: Mapping[str, object] | None = None
    #: The prompt position (end token) of one of the request's keys, if the engine
    #: knows it (vLLM's ``ReqContext.get_offload_key_position``).
    key_position: Callable[[Key], int | None] | None = None


@dataclass(frozen=True, slots=True)
class TransferJob:
    """A store (primary -> tier, slots pinned) or load (tier -> primary, slots reserved)."""

    job_id: int
    keys: tuple[Key, ...]
    slots: tuple[int, ...]
    request: RequestContext

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.slots):
            raise ValueError(
                f"transfer job {self.job_id}: {len(self.keys)} keys but {len(self.slots)} slots"
            )


@dataclass(frozen=True, slots=True)
class JobResult:
    """Outcome of a submitted job; every job is reported exactly once.

    A successful load also says how long it took from its fetch (``transfer_seconds``)
    and how many bytes it brought (``transfer_bytes``); they do not take part in
    equality (a result is its job and its outcome)."""

    job_id: int
    success: bool
    transfer_seconds: float | None = field(default=None, compare=False)
    transfer_bytes: int | None = field(default=None, compare=False)
