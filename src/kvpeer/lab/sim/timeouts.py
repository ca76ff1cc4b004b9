"""Timeouts of the simulated tiers and the bounds the checker derives from them.

Every bound is "the longest the tier may legitimately take" plus a slack for
simulated time moving in ticks (a timer fires at the first step at or after
its deadline, so each timer in a chain can be up to one tick late) and for
control frames spending up to the largest link delay in flight.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvpeer.config import TierConfig
from kvpeer.lab.sim.prompts import Blocks
from kvpeer.testing.clock import FakeClock

if TYPE_CHECKING:
    from kvpeer.lab.sim.budgets import Reach

__all__ = ["Bounds", "SimContext", "Timeouts"]

PORT = 5710


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Short tier timeouts, so a few hundred ticks exercise every expiry path.

    The request budgets (``peer_wait``, the back-off cap) and the transport's
    heartbeat are drawn per seed (:meth:`drawn`). Every request budget stays
    under the session timeouts (``handshake``, ``load``, ``lookup``) by more
    than the checker's slack, so a request that waits out a session timeout
    instead of its budget is told apart. ``overrides`` change what the tier is
    really given, not what the checker expects (negative controls).
    """

    load: float = 7.0
    abort_ack: float = 1.0
    lookup: float = 7.0
    lookup_pending: float = 0.5
    store: float = 3.0
    unbound_store: float = 5.0
    tombstone: float = 8.0
    handshake: float = 9.0
    abort_drain: float = 0.5  # under abort_ack, as a fleet must be (docs/simulation.md)
    peer_wait: float = 1.0
    peer_retry_max: float = 4.0
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 1.0
    #: a busy engine's bound (kvpeer.node.enginewait): over a tick, so an engine that
    #: steps every tick serves its peers, and one frozen or slow is answered without
    engine_wait: float = 1.0
    overrides: tuple[tuple[str, float], ...] = ()

    @classmethod
    def drawn(cls, rng: random.Random, answer: float, tick: float) -> Timeouts:
        """The request budgets and heartbeat of one seed, within sane ranges.

        ``answer``: the longest a healthy peer takes to answer a frame here (a
        tick for it to step, the frame's way back, a tick for us to step; a real
        node's driver answers in milliseconds). A quiet peer is pinged
        ``peer_wait_s / 4`` into a wait, at our next step (up to ``tick`` late),
        and must answer within the rest: ``peer_wait_s`` exceeds
        ``4/3 x (answer + tick)`` (seeds 19981, 23847, 25690 and 51251 drew
        less, and gave healthy peers up), as the default 1.5 s exceeds a real
        peer's answer.
        """
        interval = rng.uniform(0.1, 0.3)
        return cls(
            peer_wait=4 / 3 * (answer + tick) + rng.uniform(0.1, 1.0),
            peer_retry_max=rng.choice((1.0, 2.0, rng.uniform(1.0, 8.0))),
            heartbeat_interval=interval,
            heartbeat_timeout=rng.uniform(max(0.4, 2 * interval), 1.2),
            engine_wait=2 * tick,  # no draw: every seed keeps its world
        )

    def overridden(self, **values: float) -> Timeouts:
        return replace(self, overrides=self.overrides + tuple(values.items()))

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
                "peer_wait_s": self.peer_wait,
                "peer_retry_max_s": self.peer_retry_max,
                "heartbeat_interval_s": self.heartbeat_interval,
                "heartbeat_timeout_s": self.heartbeat_timeout,
                "engine_wait_s": self.engine_wait,
                **dict(self.overrides),
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

    # -- request budgets toward unreachable peers (kvpeer.lab.sim.budgets) ---------------

    @property
    def budget_slack(self) -> float:
        """A fault is seen at the first tick after it (the network updates before nodes
        step); a timer fires at the first step at or after its deadline; a lookup of
        the step it fired in was asked before the tier polled."""
        return 2 * self.max_tick + 0.01

    @property
    def refused(self) -> float:
        """Waiting on a peer whose process is gone (connection refused or reset)."""
        return self.budget_slack

    @property
    def silent(self) -> float:
        """Waiting on a peer that answers nothing (partitioned, frozen, no host): the
        request budget ``peer_wait_s`` (from the peer's last frame, or from when the
        request began to wait); never a session timeout or the transport's heartbeat."""
        return self.timeouts.peer_wait + self.budget_slack

    @property
    def recovery(self) -> float:
        """After the path to a peer healed: its last failed attempt (``peer_wait_s``
        after the heal at the latest), then the longest back-off."""
        t = self.timeouts
        return t.peer_wait + t.peer_retry_max + 2 * self.max_delay + self.budget_slack

    @property
    def answer(self) -> float:
        """A healthy peer's answer to a frame: it steps within a tick, the answer
        travels back, we step within a tick."""
        return 2 * self.max_tick + 2 * self.max_delay

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
    reach: Reach | None = None  # set by the world once its network exists

    def violate(self, where: str, message: str) -> None:
        self.violations.append(f"t={self.clock.now - self.start:.2f}s {where}: {message}")
