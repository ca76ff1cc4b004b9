"""Timeouts of the simulated tiers and the bounds the checker derives from them.

Every bound is "the longest the tier may legitimately take" plus a slack for
simulated time moving in ticks (a timer fires at the first step at or after
its deadline, so each timer in a chain can be up to one tick late) and for
control frames spending up to the largest link delay in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpeer.config import TierConfig
from kvpeer.sim.prompts import Blocks
from kvpeer.testing.clock import FakeClock

__all__ = ["Bounds", "SimContext", "Timeouts"]

PORT = 5710


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Short tier timeouts, so a few hundred ticks exercise every expiry path."""

    load: float = 3.0
    abort_ack: float = 1.0
    lookup: float = 3.0
    lookup_pending: float = 0.5
    store: float = 3.0
    unbound_store: float = 5.0
    tombstone: float = 8.0
    handshake: float = 3.0
    abort_drain: float = 0.5  # under abort_ack, as a fleet must be (README)

    def tier_config(self, host: str) -> TierConfig:
        return TierConfig.from_dict(
            {
                "host": host,
                "port": PORT,
                "load_timeout_s": self.load,
                "abort_ack_timeout_s": self.abort_ack,
                "lookup_timeout_s": self.lookup,
                "lookup_pending_timeout_s": self.lookup_pending,
                "store_timeout_s": self.store,
                "unbound_store_timeout_s": self.unbound_store,
                "tombstone_retention_s": self.tombstone,
                "handshake_timeout_s": self.handshake,
                "abort_drain_timeout_s": self.abort_drain,
            }
        )

    def settle_time(self) -> float:
        """How long after every request finished the tiers may still hold anything:
        parked stores reaped, then their tombstone expiring, is the longest chain;
        a bound supply's timeout and an abort's ack and drain follow in parallel."""
        return self.unbound_store + self.tombstone + self.store + self.abort_ack + self.abort_drain


@dataclass(frozen=True, slots=True)
class Bounds:
    """How long each kind of thing may live, in simulated seconds."""

    timeouts: Timeouts
    max_delay: float  # largest one-way control delay
    max_tick: float  # largest clock step between two engine steps

    @property
    def slack(self) -> float:
        return 3 * self.max_tick + 2 * self.max_delay + 0.01

    @property
    def load(self) -> float:
        """Submit -> report of a load: load timeout, then the abort_ack timeout."""
        return self.timeouts.load + self.timeouts.abort_ack + self.slack

    @property
    def serve(self) -> float:
        """Pin of lookup supply -> report: unfetched supply times out; a fetched
        one is written, or aborted by the consumer and drained."""
        t = self.timeouts
        return t.store + t.load + self.max_delay + t.abort_drain + self.slack

    @property
    def producer_store(self) -> float:
        """Submit -> report of a producer's store: parked, then bound supply."""
        return self.timeouts.unbound_store + self.serve

    @property
    def local_store(self) -> float:
        """A store nobody will fetch is reported at the next step."""
        return self.slack

    @property
    def deferred(self) -> float:
        """A request may wait on unanswered probes, then on its load."""
        t = self.timeouts
        return t.lookup + t.load + t.abort_ack + self.slack

    @property
    def parked(self) -> float:
        return self.timeouts.unbound_store + self.slack

    @property
    def tombstone(self) -> float:
        """After the failed parked store that created it."""
        return self.timeouts.tombstone + self.slack

    @property
    def early_fetch(self) -> float:
        """After the consumer submitted the load whose fetch created it."""
        t = self.timeouts
        return t.handshake + t.load + t.abort_ack + self.slack

    @property
    def consumer_entry(self) -> float:
        """After the consumer request finished: an abort, then an owed ack."""
        return 2 * self.timeouts.abort_ack + self.slack


@dataclass(slots=True)
class SimContext:
    """What every part of one world shares: time, bytes, bounds, findings."""

    clock: FakeClock
    blocks: Blocks
    bounds: Bounds
    start: float
    violations: list[str] = field(default_factory=list)
    # peer id -> kv_request_id -> last time some node submitted a load from it
    loads_toward: dict[str, dict[str, float]] = field(default_factory=dict)
    corrupt_loads: bool = False

    def violate(self, where: str, message: str) -> None:
        self.violations.append(f"t={self.clock.now - self.start:.2f}s {where}: {message}")
