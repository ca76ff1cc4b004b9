"""The reference host: a primary block pool and a tiering manager without vLLM.

It drives any :class:`~kvpeer.host.interface.SecondaryTier` the way vLLM's tiering
manager does, so kvpeer's tier runs in simulations, benchmarks and other engines.
"""

from kvpeer.host.manager import HostStatistics, JobKind, StepReport, StoreOutcome, TieringHost
from kvpeer.host.pool import BlockPool, PoolStatistics, SlotState

__all__ = [
    "BlockPool",
    "HostStatistics",
    "JobKind",
    "PoolStatistics",
    "SlotState",
    "StepReport",
    "StoreOutcome",
    "TieringHost",
]
