"""The engine-facing tier: request routing over the peer table and producer bindings.

:class:`Tier` takes the engine's calls, routes each request's roles to the
sessions of :mod:`kvpeer.node.peertable` (who may have a session, how one
ends) and the parked supply of :mod:`kvpeer.node.bindings` (which peer serves
a PD id), and applies what sessions yield: job results, failed ids, serve
requests to release.

Invariants:

1. Every job the engine submits is reported exactly once by
   :meth:`Tier.get_finished_jobs` (or immediately queued when there is
   nothing to do for it).
2. A consumer request answers MISS from the moment its load failed, its peer
   died, its peer was backed off or its probes timed out, until it finishes
   (``_failed`` holds only ids of live consumer requests).
3. No collection grows with the number of requests ever served: per-request
   entries leave at ``on_request_finished``, everything else expires.
   An id's consumer state in a session (probes, loads, the peer's lookup
   state) is finished when the last open request pulling that id from that
   peer finishes: a twin (parallel sampling: same id, same peer) finishing
   neither aborts its sibling's loads nor drops its waiting probes.
4. A dead session is reaped within one poll: its loads and stores fail, its
   waiting probes answer MISS, its serve requests are released at the next
   serve window, and every live request pulling from that peer computes
   locally - except after ``RENEWED`` (the peer, same process, began its next
   session: ``kvpeer.session.peer`` invariant 3), where only the ids the
   session held state for do; a request that had not yet used the session
   goes on in the fresh one.
5. After :meth:`Tier.shutdown` nothing is held: every job still pending was
   failed, the held blocks were released, and the results stay readable
   through ``get_finished_jobs``.
6. With held blocks (``held_bytes``, :mod:`kvpeer.node.held`), every block a
   store job names is copied before that job can be reported (held invariant
   2); the held copies never hold an engine job open.
7. The engine waits in a lookup (``pull_confirmed``) only for a source that holds
   the blocks over a ready session and that :mod:`kvpeer.node.pullwaits` allows
   (not back-off after waits in vain; bounded by ``max_peers`` entries).

:meth:`Tier.poll` receives and runs timers; :meth:`Tier.get_finished_jobs`
polls first, so an engine that drives a tier by itself needs nothing else. A
driver thread (:class:`kvpeer.node.driver.DrivenTier`) polls instead and
collects results with :meth:`Tier.take_results`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvpeer.config import TierConfig
from kvpeer.errors import ProtocolError
from kvpeer.node.ahead import KeysOf, PullAhead, RowCopy
from kvpeer.node.bindings import Bindings
from kvpeer.node.counters import CounterSnapshot, TierCounters
from kvpeer.node.held import HeldBlocks
from kvpeer.node.params import LOCAL, Routing, Source, parse_transfer_params
from kvpeer.node.peertable import Peer, PeerTable, PeerView, Polled
from kvpeer.node.pullwaits import PullWaits
from kvpeer.node.trace import Trace
from kvpeer.protocol import Prefetch
from kvpeer.session import CloseKind, PeerSession
from kvpeer.session.ports import Parent
from kvpeer.transport.base import ControlTransport, InboundFrame, NodeDataPlane
from kvpeer.types import (
    JobResult,
    Key,
    LookupResult,
    OffloadPolicy,
    RequestContext,
    ServeRequest,
    TransferJob,
)

__all__ = ["Tier", "TierStatistics"]

log = logging.getLogger("kvpeer.tier")

# Members the hot paths compare against, bound once: ``Enum.MEMBER`` goes through
# EnumType.__getattr__ on Python 3.11 (~0.2 us an access, millions per simulated world).
_HIT: Final = LookupResult.HIT
_MISS: Final = LookupResult.MISS
_RETRY: Final = LookupResult.RETRY


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


class Tier:
    """kvpeer's secondary tier for one engine (implements SecondaryTier)."""

    def __init__(
        self,
        config: TierConfig,
        control: ControlTransport,
        data_plane: NodeDataPlane,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None] | None = None,
        hash_seed: str | Callable[[], str] | None = None,
        boot_id: bytes | None = None,
        trace: bool = False,
        held: HeldBlocks | None = None,
    ) -> None:
        """``hash_seed`` may be a callable: resolved when the first session opens
        (vLLM knows its prefix-hash seed only after the tier was built). ``trace``:
        log every step of each pull on ``kvpeer.trace`` (:mod:`kvpeer.node.trace`).
        ``held``: a copy of stored blocks to serve peers from without a serve
        window (:mod:`kvpeer.node.held`; the tier owns and closes it)."""
        self._config = config
        self._held = held
        self._trace = Trace(control.local_id, enabled=trace, block_len=lambda: self.block_len)
        self._control = control
        self._data = data_plane
        self._clock = clock
        self._sleep = sleep
        self._counters = TierCounters()
        self._peers = PeerTable(
            config,
            control,
            data_plane,
            self._counters,
            pulled_from=self._pulled_from,
            hash_seed=hash_seed,
            boot_id=boot_id,
            trace=self._trace,
            held=held,
        )
        self._bindings = Bindings(
            self._peers,
            self._counters,
            unbound_store_timeout_s=config.unbound_store_timeout_s,
            tombstone_retention_s=config.tombstone_retention_s,
            early_fetch_ttl_s=config.load_timeout_s + config.abort_ack_timeout_s,
        )
        self._requests: dict[str, Routing] = {}
        self._consumer_refs: dict[str, int] = {}
        self._pulling: dict[tuple[str, str], int] = {}  # (peer, id) -> open requests
        self._failed: set[str] = set()
        self._results: list[JobResult] = []
        self._unreleased: list[ServeRequest] = []
        self._blocks_loaded = 0
        self._load_seconds = 0.0
        self._ended: Counter[str] = Counter()
        self._block_len: int | None = None
        self._shut_down = False
        self._steps = 0  # on_schedule_end calls: the engine's scheduler steps
        self._waits = PullWaits(config.max_peers)  # sources the engine may wait for
        self._ahead = PullAhead(config, self._counters, control.local_id)

    def configure_staging(
        self, rows: list[int], keys_of: KeysOf, copy: RowCopy, block_len: int
    ) -> None:
        """The host withheld ``rows`` of its primary region for blocks pulled ahead
        (:mod:`kvpeer.node.ahead`); ``keys_of`` hashes a prompt as the engine does."""
        self._ahead.configure(rows, keys_of, copy, block_len)

    @property
    def ahead(self) -> PullAhead:
        return self._ahead

    def reset_staging(self) -> frozenset[int]:
        """The engine dropped its cache: drop what is staged (:meth:`PullAhead.clear`);
        the staging rows, which the engine must keep withholding."""
        self._results.extend(self._ahead.clear())
        return self._ahead.rows

    def staged_state(
        self, keys: Sequence[Key], request: RequestContext | None = None
    ) -> bool | None:
        """Pulled ahead: every key staged (True), some still being fetched from
        ``request``'s source (False), or not (None) (:meth:`PullAhead.state`)."""
        routing = self._requests.get(request.req_id, LOCAL) if request is not None else LOCAL
        source = routing.source
        if source is not None and not source.probe:
            return None  # a PD consumer never takes staged blocks
        return self._ahead.state(keys, source.peer_id if source is not None else None)

    def adopt_staged(
        self, keys: Sequence[Key], rows: list[int], request: RequestContext
    ) -> list[int] | None:
        """The engine takes the staged rows of ``keys`` into its cache and gives ``rows``
        in their place (:meth:`PullAhead.adopt`); None: not every key is staged."""
        taken = self._ahead.adopt(keys, rows)
        if taken is not None and self._trace.enabled:
            source = self._requests.get(request.req_id, LOCAL).source
            self._trace.emit(source.kv_request_id if source else request.req_id,
                             "staged_adopted", blocks=len(keys), step=self._steps)  # fmt: skip
        return taken

    # -- SecondaryTier -----------------------------------------------------------

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        if self._shut_down:
            return OffloadPolicy.CHUNK_LEVEL
        routing = parse_transfer_params(request.kv_transfer_params)
        for problem in routing.problems:
            log.warning("request %s: kv_transfer_params: %s", request.req_id, problem)
        now = self._clock()
        source = routing.source
        backed_off = source is not None and self._peers.backed_off(source.peer_id, now)
        if backed_off:
            log.info(
                "request %s: peer %s was unreachable a moment ago; computing locally",
                request.req_id,
                source.peer_id if source is not None else "",
            )
        elif source is not None and self._open(source.peer_id, now) is None:
            log.warning(
                "request %s: peer %s refused (allow-list or peer cap); computing locally",
                request.req_id,
                source.peer_id,
            )
            routing = Routing(None, routing.destination, routing.problems)
            source = None
        self._requests[request.req_id] = routing
        if source is not None:
            self._consumer_refs[source.kv_request_id] = (
                self._consumer_refs.get(source.kv_request_id, 0) + 1
            )
            pulled = (source.peer_id, source.kv_request_id)
            self._pulling[pulled] = self._pulling.get(pulled, 0) + 1
            if backed_off:
                self._fail_id(source.kv_request_id)  # MISS at once (peertable invariant 7)
        destination = routing.destination
        if destination is None:
            return OffloadPolicy.CHUNK_LEVEL
        self._results.extend(
            self._bindings.producer_started(destination.kv_request_id, request.req_id, now)
        )
        return OffloadPolicy.REQUEST_LEVEL

    def lookup(self, key: Key, request: RequestContext) -> LookupResult:
        result = self._lookup(key, request)
        self._counters.lookups[result.name] += 1
        return result

    def _lookup(self, key: Key, request: RequestContext) -> LookupResult:
        source = self._requests.get(request.req_id, LOCAL).source
        source_peer = source.peer_id if source is not None else None
        if (source is None or source.probe) and self._ahead.holds(key, source_peer):
            # pulled ahead (kvpeer.node.ahead): no peer to ask. Not for a PD consumer:
            # its producer parks its stores for one fetch of them all.
            self._ahead.found(request.req_id)
            return _HIT
        if source is None or source.kv_request_id in self._failed:
            return _MISS
        if not source.probe:
            if self._trace.enabled:
                self._trace.lookup_hit(source.kv_request_id, source.peer_id, self._steps)
            return _HIT  # PD: the prefiller will have every block
        peer = self._peers.get(source.peer_id)
        if peer is None or not peer.session.alive:
            return _MISS
        now = self._clock()
        peer.last_used = now
        held = self._held_answer(key, request, source, peer.session.resolves_fetches)
        if held is not None:
            return held
        if self._trace.enabled:
            self._trace.lookup_asked(source.kv_request_id, source.peer_id, self._steps)
        answer = peer.session.register_probe(source.kv_request_id, key, now)
        if answer is None:
            return _RETRY
        if answer and self._trace.enabled:
            self._trace.lookup_hit(source.kv_request_id, source.peer_id, self._steps)
        return _HIT if answer else _MISS

    def _held_answer(
        self, key: Key, request: RequestContext, source: Source, resolves: bool
    ) -> LookupResult | None:
        """The router's word for ``key`` (``held_tokens``), if the peer can be asked to
        resolve the fetch itself; None: probe it. A key answered so is fetched with
        ``resolve``: a block the peer no longer holds fails the load, and the engine
        computes it (consumer invariant 1 keeps it MISS)."""
        if source.held_tokens is None or not resolves or request.key_position is None:
            return None
        position = request.key_position(key)
        if position is None:
            return None
        if position > source.held_tokens:
            return _MISS
        if self._trace.enabled:
            self._trace.lookup_hit(source.kv_request_id, source.peer_id, self._steps)
        return _HIT

    def pull_confirmed(self, request: RequestContext) -> bool:
        """Whether ``request`` pulls blocks its source already holds, over a session that
        is ready, so a load is worth waiting for on the engine thread: confirmed by a
        probe or named by the router (symmetric), or a PD prefill the orchestrator saw
        answer (``prefill_done``); a PD consumer sent before that may wait for a prefill
        still being computed, and a session still shaking hands is slow by nature."""
        if self._ahead.confirmed(request.req_id):
            return True  # its keys are staged, or being fetched into staging now
        source = self._requests.get(request.req_id, LOCAL).source
        if source is None or source.kv_request_id in self._failed:
            return False
        peer = self._peers.get(source.peer_id)
        if peer is None or not peer.session.ready:
            return False
        if not self._waits.allowed(source.peer_id, self._clock()):
            return False  # it made the engine wait in vain: not waited for now
        return source.probe or source.prefill_done

    def promotion_waited(self, request: RequestContext, waited_s: float, done: bool) -> None:
        """The engine waited ``waited_s`` in a lookup for a load it submitted at once;
        ``done``: it landed. What it means for later waits is
        :mod:`kvpeer.node.pullwaits`' (invariant 7)."""
        source = self._requests.get(request.req_id, LOCAL).source
        if source is None:
            return
        self._counters.pull_waits["landed" if done else "missed"] += 1
        self._counters.pull_wait_seconds.observe(waited_s)
        if self._trace.enabled:
            self._trace.promotion(source.kv_request_id, source.peer_id, waited_s=waited_s,
                                  done=done, step=self._steps)  # fmt: skip
        if done:
            self._waits.landed(source.peer_id)
        else:
            self._waits.missed(source.peer_id, self._clock())

    def submit_load(self, job: TransferJob) -> None:
        source = self._requests.get(job.request.req_id, LOCAL).source
        staged = (
            self._ahead.take(job, self._clock(), source.peer_id if source else None,
                             give_up_s=source.give_up_s if source else None)
            if source is None or source.probe
            else None
        )
        if staged is not None:  # every key staged or being fetched ahead
            self._results.extend(staged)
            return
        if source is None or self._shut_down:
            self._results.append(JobResult(job.job_id, False))
            return
        if not job.keys:
            self._results.append(JobResult(job.job_id, True))
            return
        peer = self._peers.get(source.peer_id)
        if peer is None or not peer.session.alive or source.kv_request_id in self._failed:
            self._results.append(JobResult(job.job_id, False))
            self._fail_id(source.kv_request_id)
            return
        now = self._clock()
        peer.last_used = now
        if self._trace.enabled:
            self._trace.load_submitted(source.kv_request_id, source.peer_id, job.job_id,
                                       len(job.keys), self._steps)  # fmt: skip
        try:
            peer.session.request_blocks(job.job_id, source.kv_request_id, job.keys, job.slots,
                                        now, prefill_done=source.prefill_done,
                                        resolve=source.held_tokens is not None,
                                        give_up_s=source.give_up_s)  # fmt: skip
        except ProtocolError as exc:
            log.error("load %s of request %s refused: %s", job.job_id, job.request.req_id, exc)
            self._results.append(JobResult(job.job_id, False))
            self._fail_id(source.kv_request_id)

    def submit_store(self, job: TransferJob) -> None:
        if self._held is not None and not self._shut_down:
            self._held.keep(job.keys, job.slots)  # before the job can be reported (inv. 6)
        destination = self._requests.get(job.request.req_id, LOCAL).destination
        if destination is None:
            self._results.append(JobResult(job.job_id, True))  # nobody will fetch it
            return
        if self._shut_down:
            self._results.append(JobResult(job.job_id, False))
            return
        self._results.extend(self._bindings.store(destination.kv_request_id, job, self._clock()))

    def get_finished_jobs(self) -> list[JobResult]:
        """Poll, then every job result not reported yet."""
        self.poll()
        return self.take_results()

    def take_results(self) -> list[JobResult]:
        """Every job result not reported yet, without polling (a driver polls)."""
        results, self._results = self._results, []
        if self._trace.enabled:
            for result in results:
                self._trace.load_reported(result.job_id, result.success, self._steps)
        return results

    def poll(self) -> None:
        """Receive, run timers and completions (the driver thread calls this)."""
        if not self._shut_down:
            self._tick(self._clock())

    def next_deadline(self) -> float | None:
        """When :meth:`poll` is next due for a timer (frames wake it anyway)."""
        deadlines = [
            self._peers.next_deadline(),
            self._bindings.next_deadline(),
            self._control.next_deadline(),
            self._ahead.next_deadline(),
        ]
        return min((d for d in deadlines if d is not None), default=None)

    def serve_external_requests(self, parent: Parent) -> None:
        unreleased, self._unreleased = self._unreleased, []
        for serve in unreleased:
            parent.on_request_finished(serve)
        now = self._clock()
        for peer in list(self._peers):
            if peer.session.needs_serve():
                if peer.serve_wait_since is not None:
                    self._counters.step_wait_seconds.observe(now - peer.serve_wait_since)
                peer.session.serve(parent, now)
                # What is still waiting (keys not stored yet) waits for data from now on.
                peer.serve_wait_since = now if peer.session.needs_serve() else None

    def has_results(self) -> bool:
        return bool(self._results)

    def fail_job(self, job_id: int) -> None:
        """Report a job the tier could not take (e.g. after a driver crash) as failed."""
        self._results.append(JobResult(job_id, False))

    def has_transfers(self) -> bool:
        """Loads or writes in flight that may still touch the primary region."""
        return any(p.session.has_transfers() for p in self._peers)

    def needs_serve(self) -> bool:
        """Peer work waits for a serve window (an idle engine should step)."""
        return bool(self._unreleased) or any(p.session.needs_serve() for p in self._peers)

    def on_schedule_end(self) -> None:
        self._steps += 1  # the engine's scheduler steps (trace lines carry it)
        for peer in self._peers:
            peer.session.flush_lookups()

    def on_request_finished(self, request: RequestContext) -> None:
        self._ahead.forget(request.req_id)
        routing = self._requests.pop(request.req_id, LOCAL)
        now = self._clock()
        source = routing.source
        if source is not None:
            kv_request_id = source.kv_request_id
            if self._trace.enabled:
                self._trace.forget(kv_request_id, source.peer_id, self._steps)
            pulled = (source.peer_id, kv_request_id)
            users = self._pulling.get(pulled, 1) - 1
            if users > 0:
                self._pulling[pulled] = users  # a twin still pulls it (invariant 3)
            else:
                self._pulling.pop(pulled, None)
                peer = self._peers.get(source.peer_id)
                if peer is not None:
                    peer.session.finish_consumer(kv_request_id, now)
            refs = self._consumer_refs.get(kv_request_id, 1) - 1
            if refs > 0:
                self._consumer_refs[kv_request_id] = refs
            else:
                self._consumer_refs.pop(kv_request_id, None)
                self._failed.discard(kv_request_id)
        destination = routing.destination
        if destination is not None:
            self._bindings.producer_finished(destination.kv_request_id, request.req_id, now)

    def has_pending_work(self) -> bool:
        return bool(self._results or self._unreleased) or any(
            peer.session.has_work() for peer in self._peers
        )

    def drain_jobs(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until no transfer touches the primary region."""
        deadline = self._clock() + timeout_s
        while True:
            self._tick(self._clock())
            busy = [p for p in self._peers if p.session.has_work()]
            if not busy or self._clock() >= deadline or self._sleep is None:
                if busy:
                    log.warning(
                        "drain_jobs: %d sessions still busy after %gs", len(busy), timeout_s
                    )
                return
            self._sleep(0.001)

    def shutdown(self) -> None:
        """Fail everything still held; results stay readable via get_finished_jobs."""
        if self._shut_down:
            return
        now = self._clock()
        self._apply(self._peers.close_all("tier shutting down", now), now)
        self._results.extend(self._bindings.fail_parked())
        self._results.extend(self._ahead.shutdown())
        self._control.close()
        self._data.close()
        if self._held is not None:
            self._held.close()  # after the planes: nothing reads a held row any more
        self._shut_down = True

    # -- statistics --------------------------------------------------------------

    def statistics(self) -> TierStatistics:
        loads = transfers = pins = 0
        stale = self._counters.retired_stale_frames
        for peer in self._peers:
            stats = peer.session.statistics()
            stale += stats.stale_frames
            loads += stats.consumer.loads_in_flight
            transfers += stats.producer.transfers_in_flight
            pins += stats.producer.pinned_blocks
        table = self._peers.statistics()
        bindings = self._bindings.statistics()
        held = self._held.statistics() if self._held is not None else None
        staged, _, staging_free = self._ahead.statistics()
        return TierStatistics(
            sessions=table.sessions,
            requests=len(self._requests),
            consumer_ids=len(self._consumer_refs),
            producer_ids=bindings.producer_ids,
            failed_ids=len(self._failed),
            bound_ids=bindings.bound_ids,
            parked_ids=bindings.parked_ids,
            parked_batches=bindings.parked_batches,
            tombstones=bindings.tombstones,
            early_fetches=bindings.early_fetches,
            loads_in_flight=loads,
            transfers_in_flight=transfers,
            pinned_blocks=pins,
            results_pending=len(self._results),
            peers_refused=table.peers_refused,
            stray_frames=table.stray_frames + stale,
            blocks_loaded=self._blocks_loaded,
            sessions_ended=dict(self._ended),
            held_blocks=held.blocks if held is not None else 0,
            held_bytes=held.bytes if held is not None else 0,
            staged_blocks=staged,
            staging_free=staging_free,
        )

    def held(self) -> HeldBlocks | None:
        """The held blocks, if ``held_bytes`` > 0 (for inspection, under the lock)."""
        return self._held

    def activity(self) -> int:
        """Grows with every counted event; safe to read without the lock
        (:meth:`TierCounters.activity`)."""
        return self._counters.activity()

    def counters(self) -> CounterSnapshot:
        """Since-start event counts and histograms, live sessions included
        (under the node's lock, like :meth:`statistics`)."""
        c = self._counters
        served, unknown = c.retired_blocks_served, c.retired_unknown_messages
        timeouts: Counter[str] = Counter()
        timeouts.update(c.retired_timeouts)
        timeouts.update(c.timeouts)
        for peer in self._peers:
            stats = peer.session.statistics()
            served += stats.producer.blocks_written
            unknown += stats.unknown_messages
            timeouts.update(stats.consumer.timeouts)
            timeouts.update(stats.producer.timeouts)
        timeouts["handshake"] += self._ended[CloseKind.TIMEOUT.value]
        return CounterSnapshot(
            lookups=dict(c.lookups),
            loads_ok=c.loads_ok,
            loads_failed=c.loads_failed,
            sessions_opened=c.sessions_opened,
            late_fetches_rejected=c.late_fetches_rejected,
            stores_reaped=c.stores_reaped,
            blocks_served=served,
            unknown_messages=unknown,
            timeouts=dict(timeouts),
            lookup_seconds=c.lookup_seconds.snapshot(),
            load_seconds=c.load_seconds.snapshot(),
            load_bytes=c.load_bytes.snapshot(),
            step_wait_seconds=c.step_wait_seconds.snapshot(),
            pull_waits=dict(c.pull_waits),
            pull_wait_seconds=c.pull_wait_seconds.snapshot(),
            ahead=dict(c.ahead),
        )

    def peers(self, limit: int = 256) -> tuple[list[PeerView], int]:
        """At most ``limit`` peers as an operator sees them, and how many there are
        (under the node's lock, like :meth:`statistics`)."""
        return self._peers.view(self._clock(), limit)

    def _retire(self, session: PeerSession) -> None:
        """Keep what an ending session counted (counters invariant 3)."""
        stats = session.statistics()
        c = self._counters
        c.retired_blocks_served += stats.producer.blocks_written
        c.retired_unknown_messages += stats.unknown_messages
        c.retired_stale_frames += stats.stale_frames
        c.retired_timeouts.update(stats.consumer.timeouts)
        c.retired_timeouts.update(stats.producer.timeouts)

    @property
    def steps(self) -> int:
        """The engine's scheduler steps so far (``on_schedule_end`` calls)."""
        return self._steps

    @property
    def blocks_loaded(self) -> int:
        """Blocks successful loads brought from peers since start (one int: safe to
        read from any thread, unlike :meth:`statistics`)."""
        return self._blocks_loaded

    @property
    def load_seconds(self) -> float:
        """Seconds successful loads took, fetch to completion, summed (like
        :attr:`blocks_loaded`, readable from any thread)."""
        return self._load_seconds

    @property
    def block_len(self) -> int:
        """Bytes of one block of the primary region (what one block moves)."""
        if self._block_len is None:
            self._block_len = self._data.describe().block_len
        return self._block_len

    @property
    def peer_id(self) -> str:
        """The identity this node advertises and peers dial back."""
        return self._control.local_id

    @property
    def data_planes(self) -> list[str]:
        return list(self._data.describe().offers)

    def session(self, peer_id: str) -> PeerSession | None:
        """The live session toward ``peer_id``, if any (for inspection)."""
        peer = self._peers.get(peer_id)
        return peer.session if peer is not None else None

    # -- the tick ------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        for inbound in self._control.receive():
            self._apply(self._peers.route(inbound, now), now)
        for inbound, prefetch in self._peers.take_prefetches():
            self._prefetch(inbound, prefetch, now)
        for polled in self._peers.poll(now):
            self._apply_one(polled, now)
        self._results.extend(self._bindings.expire(now))
        self._ahead.expire(now)
        self._results.extend(self._ahead.give_up(now))
        self._peers.expire(now)
        for peer in self._peers:  # peer work reached us: its wait for a step starts
            if peer.serve_wait_since is None and peer.session.needs_serve():
                peer.serve_wait_since = now
        self._control.flush()  # what this tick queued goes out now, not next loop

    def _prefetch(self, inbound: InboundFrame, message: Prefetch, now: float) -> None:
        """A router's prefetch (kvpeer.node.ahead): fetch into staging now, or refuse."""
        if message.kv_request_id in self._consumer_refs:
            # the request came first and pulls for itself: a second fetch would only
            # move the same blocks twice
            self._counters.ahead["prefetches"] += 1
            self._counters.ahead["refused"] += 1
            self._peers.refuse_prefetch(inbound, message, "its request is here already")
            return
        fetch = self._ahead.admit(inbound.source, message, now)
        if isinstance(fetch, str):
            self._peers.refuse_prefetch(inbound, message, fetch)
            return
        backed_off = self._peers.backed_off(fetch.peer_id, now)
        peer = None if backed_off else self._open(fetch.peer_id, now)
        if peer is None:
            self._ahead.abandon(fetch)
            self._peers.refuse_prefetch(inbound, message, f"cannot reach {fetch.peer_id} now "
                                        "(backed off, allowed_peers or max_peers)")  # fmt: skip
            return
        peer.last_used = now
        if self._trace.enabled:
            self._trace.emit(fetch.kv_request_id, "prefetch", peer=fetch.peer_id,
                             request=message.kv_request_id, blocks=len(fetch.keys))  # fmt: skip
        try:
            peer.session.request_blocks(fetch.job_id, fetch.kv_request_id, fetch.keys,
                                        fetch.rows, now, resolve=True)  # fmt: skip
        except ProtocolError as exc:
            self._ahead.abandon(fetch)
            self._peers.refuse_prefetch(inbound, message, f"fetch refused: {exc}")

    def _pulled_from(self) -> set[str]:
        """Peers a live request pulls from (eviction spares their sessions)."""
        return {r.source.peer_id for r in self._requests.values() if r.source is not None}

    def _open(self, peer_id: str, now: float) -> Peer | None:
        """The peer table's live session toward ``peer_id`` (None: refused), after
        applying what the sessions it ended to open it yielded."""
        opened = self._peers.open(peer_id, now)
        self._apply(opened.polled, now)
        return opened.peer

    def _apply(self, polled: list[Polled], now: float) -> None:
        """Apply what sessions yielded (the peer table dropped those that closed)."""
        for each in polled:
            self._apply_one(each, now)

    def _apply_one(self, polled: Polled, now: float) -> None:
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
                                 bytes=load.blocks * self.block_len, seconds=load.seconds,
                                 reason=load.reason or None)  # fmt: skip
            if ahead:
                self._ahead_landed(peer, load.job_id, load.kv_request_id, load.success, now)
            else:
                self._results.append(
                    JobResult(
                        load.job_id,
                        load.success,
                        load.seconds if load.success else None,
                        load.blocks * self.block_len if load.success else None,
                    )
                )
            self._blocks_loaded += load.blocks
            if load.success:
                peer.blocks_pulled += load.blocks
            self._load_seconds += load.seconds
            if load.success:
                counters.loads_ok += 1
                counters.load_seconds.observe(load.seconds)
                counters.load_bytes.observe(load.blocks * self.block_len)
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
                    self._fail_id(load.kv_request_id)
        self._results.extend(JobResult(s.job_id, s.success) for s in result.stores)
        for kv_request_id in result.expired_probe_ids:
            log.info("lookups of %s at %s timed out; computing locally", kv_request_id, peer_id)
            self._fail_id(kv_request_id)
        for kv_request_id in result.fetched_ids:
            done = kv_request_id in result.prefilled_ids
            self._results.extend(
                self._bindings.fetched(kv_request_id, peer_id, now, prefill_done=done)
            )
        closed = result.closed
        if closed is None:
            return
        self._ended[closed.kind.value] += 1
        counters.loads_failed += len(closed.loads)
        self._retire(peer.session)
        for x in closed.loads:
            if self._ahead.owns(x.job_id):
                self._ahead_landed(peer, x.job_id, x.kv_request_id, x.success, now)
            else:
                self._results.append(JobResult(x.job_id, x.success))
        self._results.extend(JobResult(x.job_id, x.success) for x in closed.stores)
        for kv_request_id in closed.failed_request_ids:
            self._fail_id(kv_request_id)
        # Every live request pulling from this peer computes locally from now on,
        # even if it had nothing in flight: its peer's answers died with the session.
        # Not when the peer began its next session (RENEWED, invariant 4): its
        # process and parked stores live on, and the session failed every id it held.
        if closed.kind is not CloseKind.RENEWED:
            for routing in self._requests.values():
                if routing.source is not None and routing.source.peer_id == peer_id:
                    self._fail_id(routing.source.kv_request_id)
        self._unreleased.extend(closed.unreleased_serves)
        self._bindings.peer_gone(peer_id)

    def _ahead_landed(
        self, peer: Peer, job_id: int, kv_request_id: str, success: bool, now: float
    ) -> None:
        if self._trace.enabled:
            self._trace.emit(kv_request_id, "prefetch_done", peer=peer.session.peer_id,
                             success=success)  # fmt: skip
        self._results.extend(self._ahead.landed(job_id, success, now))
        if peer.session.alive:
            peer.session.finish_consumer(kv_request_id, now)

    def _fail_id(self, kv_request_id: str) -> None:
        if kv_request_id in self._consumer_refs:
            self._failed.add(kv_request_id)
