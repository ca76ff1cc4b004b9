"""Sans-IO peer sessions: handshake, consumer and producer roles.

Nothing here does I/O, starts threads or reads a clock; every call that can
expire something takes ``now`` and every machine has ``next_deadline()``.
"""

from kvpeer.session.consumer import ConsumerStatistics
from kvpeer.session.peer import Admit, PeerSession, SessionStatistics
from kvpeer.session.ports import DataPlane, Parent, TransferEvent
from kvpeer.session.producer import ProducerStatistics
from kvpeer.session.results import (
    CloseKind,
    LoadFinished,
    PollResult,
    SessionClosed,
    StoreFinished,
)
from kvpeer.session.settings import SessionSettings

__all__ = [
    "Admit",
    "CloseKind",
    "ConsumerStatistics",
    "DataPlane",
    "LoadFinished",
    "Parent",
    "PeerSession",
    "PollResult",
    "ProducerStatistics",
    "SessionClosed",
    "SessionSettings",
    "SessionStatistics",
    "StoreFinished",
    "TransferEvent",
]
