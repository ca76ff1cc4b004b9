"""Applying what sessions yield: job results, ids that compute locally, serves to release.

The peer table returns what its sessions yielded as :class:`~kvpeer.node.peertable.Polled`
values (a closed session already dropped); :class:`Outcomes` applies them and keeps
what the tier owes its caller: the job results not reported yet (``results``) and
the serve requests of ended sessions, released at the next serve window
(``unreleased``).

Invariants (the tier's 1 and 4, :mod:`kvpeer.node.tier`):

1. Every load and store a session reports becomes one job result - except a
   fetch into staging (:mod:`kvpeer.node.ahead`: negative job ids), which settles
   the engine jobs waiting for it instead.
2. A failed load, expired probes, and every id a closed session held state for
   fail their ids (:meth:`kvpeer.node.requests.OpenRequests.fail`); a session that
   closed other than ``RENEWED`` fails every open request pulling from its peer.
3. Nothing here calls back into the tier, and time comes in as ``now``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from kvpeer.node.ahead import PullAhead
from kvpeer.node.bindings import Bindings
from kvpeer.node.counters import TierCounters
from kvpeer.node.peertable import Peer, PeerTable, Polled
from kvpeer.node.requests import OpenRequests
from kvpeer.node.trace import Trace
from kvpeer.session import CloseKind
from kvpeer.types import JobResult, ServeRequest

__all__ = ["Outcomes"]

log = logging.getLogger("kvpeer.tier")  # the tier's log: operators grep one name


class Outcomes:
    """What the tier owes the engine and the parent, and the rules that fill it."""

    def __init__(
        self,
        peers: PeerTable,
        requests: OpenRequests,
        bindings: Bindings,
        ahead: PullAhead,
        counters: TierCounters,
        trace: Trace,
        block_len: Callable[[], int],
    ) -> None:
        self._peers = peers
        self._requests = requests
        self._bindings = bindings
        self._ahead = ahead
        self._counters = counters
        self._trace = trace
        self._block_len = block_len
        self.results: list[JobResult] = []  # not reported to the engine yet
        self.unreleased: list[ServeRequest] = []  # of ended sessions: for the next window
        self.blocks_loaded = 0  # since start: blocks successful loads brought from peers
        self.load_seconds = 0.0  # since start: seconds successful loads took, summed
        self.ended: Counter[str] = Counter()  # since start: sessions ended, by CloseKind

    def open(self, peer_id: str, now: float) -> Peer | None:
        """The peer table's live session toward ``peer_id`` (None: refused), after
        applying what the sessions it ended to open it yielded."""
        opened = self._peers.open(peer_id, now)
        self.apply(opened.polled, now)
        return opened.peer

    def apply(self, polled: list[Polled], now: float) -> None:
        for each in polled:
            self.apply_one(each, now)

    def apply_one(self, polled: Polled, now: float) -> None:
        peer_id, peer, result = polled.peer_id, polled.peer, polled.result
        if result.is_empty():
            return  # most polls of most sessions
        counters = self._counters
        for seconds in result.lookup_seconds:
            counters.lookup_seconds.observe(seconds)
        for load in result.loads:
            ahead = self._ahead.owns(load.job_id)  # a fetch into staging (kvpeer.node.ahead)
            if self._trace.enabled:
                self._trace.emit(load.kv_request_id, "load_done" if load.success else "load_failed",
                                 peer=peer_id, blocks=load.blocks,
                                 bytes=load.blocks * self._block_len(), seconds=load.seconds,
                                 reason=load.reason or None)  # fmt: skip
            if ahead:
                self._ahead_landed(peer, load.job_id, load.kv_request_id, load.success, now)
            else:
                self.results.append(
                    JobResult(
                        load.job_id,
                        load.success,
                        load.seconds if load.success else None,
                        load.blocks * self._block_len() if load.success else None,
                    )
                )
            self.blocks_loaded += load.blocks
            if load.success:
                peer.blocks_pulled += load.blocks
            self.load_seconds += load.seconds
            if load.success:
                counters.loads_ok += 1
                counters.load_seconds.observe(load.seconds)
                counters.load_bytes.observe(load.blocks * self._block_len())
            else:
                counters.loads_failed += 1
                log.info(
                    "load %s of %s from %s failed: %s",
                    load.job_id,
                    load.kv_request_id,
                    peer_id,
                    load.reason,
                )
                if not ahead:
                    self._requests.fail(load.kv_request_id)
        self.results.extend(JobResult(s.job_id, s.success) for s in result.stores)
        for kv_request_id in result.expired_probe_ids:
            log.info("lookups of %s at %s timed out; computing locally", kv_request_id, peer_id)
            self._requests.fail(kv_request_id)
        for kv_request_id in result.fetched_ids:
            done = kv_request_id in result.prefilled_ids
            self.results.extend(
                self._bindings.fetched(kv_request_id, peer_id, now, prefill_done=done)
            )
        closed = result.closed
        if closed is None:
            return
        self.ended[closed.kind.value] += 1
        counters.loads_failed += len(closed.loads)
        counters.retire(peer.session.statistics())
        for x in closed.loads:
            if self._ahead.owns(x.job_id):
                self._ahead_landed(peer, x.job_id, x.kv_request_id, x.success, now)
            else:
                self.results.append(JobResult(x.job_id, x.success))
        self.results.extend(JobResult(x.job_id, x.success) for x in closed.stores)
        for kv_request_id in closed.failed_request_ids:
            self._requests.fail(kv_request_id)
        # Every live request pulling from this peer computes locally from now on,
        # even if it had nothing in flight: its peer's answers died with the session.
        # Not when the peer began its next session (RENEWED, tier invariant 4): its
        # process and parked stores live on, and the session failed every id it held.
        if closed.kind is not CloseKind.RENEWED:
            self._requests.fail_pulling_from(peer_id)
        self.unreleased.extend(closed.unreleased_serves)
        self._bindings.peer_gone(peer_id)

    def _ahead_landed(
        self, peer: Peer, job_id: int, kv_request_id: str, success: bool, now: float
    ) -> None:
        if self._trace.enabled:
            self._trace.emit(kv_request_id, "prefetch_done", peer=peer.session.peer_id,
                             success=success)  # fmt: skip
        self.results.extend(self._ahead.landed(job_id, success, now))
        if peer.session.alive:
            peer.session.finish_consumer(kv_request_id, now)
