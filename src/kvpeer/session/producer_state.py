"""What a producer role keeps per peer: pinned store jobs, their supply, rounds, queued
lookups and writes in flight, and what each costs the peer's budget. Plain data; the
rules that change it are :class:`kvpeer.session.producer.ProducerRole`'s invariants.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpeer.errors import BudgetExceeded
from kvpeer.protocol import Message
from kvpeer.types import Key, ServeRequest

__all__ = [
    "ANSWER_SHARE",
    "KEY_ENTRY_BYTES",
    "LOOKUP_BYTES",
    "MAX_QUEUED_LOOKUP_KEYS",
    "REQUEST_BYTES",
    "ROUND_BYTES",
    "InboundLookup",
    "PeerBudget",
    "PinnedJob",
    "ProducerRequest",
    "ProducerStatistics",
    "Round",
    "Supply",
    "SupplyState",
    "Transfer",
    "keys_cost",
]

#: Unresolved inbound lookup keys one peer may keep queued at once.
MAX_QUEUED_LOOKUP_KEYS = 1 << 20
#: What we charge a peer's budget for state it makes us keep (invariant 8): a rough
#: upper bound of CPython's cost per entry (object, dict slots, key references).
REQUEST_BYTES = 1024
ROUND_BYTES = 256
LOOKUP_BYTES = 256
KEY_ENTRY_BYTES = 160
#: One lookup's keys may take at most ``max_peer_bytes // ANSWER_SHARE`` bytes: the
#: answer echoes them, and libzmq may hold LINK_HWM + 1 = 17 answers for a peer that
#: stopped reading before the control transport sees it (about one budget in all).
ANSWER_SHARE = 16


class SupplyState(enum.Enum):
    AVAILABLE = 1
    IN_FLIGHT = 2
    SETTLED = 3


@dataclass(slots=True, eq=False)
class PinnedJob:
    job_id: int
    kv_request_id: str
    bound_at: float
    open: int
    supplies: list[Supply] = field(default_factory=list)
    failed: bool = False
    reason: str = ""
    reported: bool = False
    held: bool = False  # pinned from held blocks: unpinned, never reported (invariant 9)


@dataclass(slots=True, eq=False)
class Supply:
    key: Key
    slot: int
    job: PinnedJob
    home: dict[Key, Supply] | None = None  # the container holding it while available
    state: SupplyState = SupplyState.AVAILABLE


@dataclass(slots=True, eq=False)
class Round:
    seq: int
    supply: dict[Key, Supply] = field(default_factory=dict)
    looked_up: bool = False  # lookup state exists: demand must have been pinned
    resolving: bool = False  # a resolve fetch's keys are still being looked up
    demand: dict[Key, int] | None = None  # unmatched demand; None until the fetch
    demanded: int = 0
    delivered: int = 0
    inflight: set[int] = field(default_factory=set)
    reply: Message | None = None  # owed once in-flight writes drained
    drain_deadline: float = 0.0
    charge: int = 0  # bytes of the peer's budget its demand holds (invariant 8)


@dataclass(slots=True, eq=False)
class InboundLookup:
    round_seq: int
    keys: tuple[Key, ...]
    received_at: float
    serve: ServeRequest | None = None
    answers: dict[Key, bool] = field(default_factory=dict)
    pending: dict[Key, None] = field(default_factory=dict)  # ordered set
    charge: int = 0  # bytes of the peer's budget it holds (invariant 8)
    implicit: bool = False  # a resolve fetch's own lookup: answered by its round's reply


@dataclass(slots=True, eq=False)
class ProducerRequest:
    rounds: dict[int, Round] = field(default_factory=dict)
    pool: dict[Key, Supply] = field(default_factory=dict)
    lookups: list[InboundLookup] = field(default_factory=list)
    closed_through: int = -1  # lookups of rounds <= this were closed by a fetch
    supply_complete: bool = False

    def is_idle(self) -> bool:
        return not (self.rounds or self.pool or self.lookups)


@dataclass(slots=True, eq=False)
class Transfer:
    kv_request_id: str
    round_seq: int
    supplies: list[Supply]
    started_at: float


class PeerBudget:
    """What the peer makes us hold, in bytes, against ``max_peer_bytes`` (invariant 8):
    :attr:`held` (queued lookups and rounds' demand, charged by whoever keeps them)
    plus an entry per request."""

    __slots__ = ("_max_bytes", "_requests", "held")

    def __init__(self, max_bytes: int, requests: dict[str, ProducerRequest]) -> None:
        self._max_bytes = max_bytes
        self._requests = requests
        self.held = 0

    def bytes(self) -> int:
        return self.held + len(self._requests) * REQUEST_BYTES

    def check(self, charge: int, kv_request_id: str, what: str) -> None:
        """Raise BudgetExceeded if ``charge`` more bytes would put the peer over budget."""
        held = self.bytes() + charge + REQUEST_BYTES
        if held > self._max_bytes:
            raise BudgetExceeded(
                f"{what} for {kv_request_id!r} would make us hold {held} bytes for this "
                f"peer (max_peer_bytes {self._max_bytes})"
            )


def keys_cost(keys: tuple[Key, ...]) -> int:
    """What ``keys`` held for the peer cost its budget."""
    return sum(len(key) for key in keys) + len(keys) * KEY_ENTRY_BYTES


@dataclass(frozen=True, slots=True)
class ProducerStatistics:
    requests: int
    rounds: int
    transfers_in_flight: int
    rounds_draining: int
    pinned_blocks: int
    store_jobs_open: int
    lookups_queued: int
    lookups_answered: int
    lookups_held: int  # of those, answered at once from held blocks (invariant 9)
    blocks_written: int
    rounds_succeeded: int
    rounds_failed: int
    #: since start, by kind: ``lookup_pending``, ``engine_wait``, ``store``, ``transfer``,
    #: ``abort_drain``
    timeouts: dict[str, int] = field(default_factory=dict)
    #: since start: peers' lookups, a resolve fetch's included, answered at once from held
    #: blocks (invariant 9) and left for the engine's serve window (invariant 1)
    lookups_from_held: int = 0
    lookups_to_engine: int = 0
