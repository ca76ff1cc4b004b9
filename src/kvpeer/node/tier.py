"""The engine-facing tier: request routing over the peer table and producer bindings.

:class:`Tier` takes the engine's calls, routes each request's roles to the
sessions of :mod:`kvpeer.node.peertable` (who may have a session, how one
ends) and the parked supply of :mod:`kvpeer.node.bindings` (which peer serves
a PD id), and reads the clock once per call. Its parts take ``now``:
:mod:`kvpeer.node.requests` (each open request's routing and pulls),
:mod:`kvpeer.node.lookups` (answering the engine's lookups),
:mod:`kvpeer.node.outcomes` (applying what sessions yield: job results, failed
ids, serve requests to release), :mod:`kvpeer.node.ahead` and
:mod:`kvpeer.node.prefetch` (pulling ahead: staging rows, a router's prefetch
carried out) and :mod:`kvpeer.node.statistics`.

Invariants:

1. Every job the engine submits is reported exactly once by
   :meth:`Tier.get_finished_jobs` (or immediately queued when there is
   nothing to do for it).
2. A consumer request answers MISS from the moment its load failed, its peer
   died, its peer was backed off or its probes timed out, until it finishes
   (failed ids are only ids of live consumer requests: requests invariant 1).
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
8. A peer's lookup that held blocks cannot answer waits for this engine's steps
   only as :mod:`kvpeer.node.enginewait` allows (``engine_wait_s``), then is
   answered without them (producer invariant 10).

:meth:`Tier.poll` receives and runs timers; :meth:`Tier.get_finished_jobs`
polls first, so an engine that drives a tier by itself needs nothing else. A
driver thread (:class:`kvpeer.node.driver.DrivenTier`) polls instead and
collects results with :meth:`Tier.take_results`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvpeer.config import TierConfig
from kvpeer.errors import ProtocolError
from kvpeer.node.ahead import KeysOf, PullAhead, RowCopy
from kvpeer.node.bindings import Bindings
from kvpeer.node.counters import CounterSnapshot, TierCounters
from kvpeer.node.enginewait import EngineWindows
from kvpeer.node.held import HeldBlocks
from kvpeer.node.lookups import Lookups
from kvpeer.node.outcomes import Outcomes
from kvpeer.node.params import Routing, parse_transfer_params
from kvpeer.node.peertable import PeerTable, PeerView
from kvpeer.node.prefetch import Prefetcher
from kvpeer.node.pullwaits import PullWaits
from kvpeer.node.requests import OpenRequests
from kvpeer.node.statistics import TierStatistics, gather
from kvpeer.node.trace import Trace
from kvpeer.session import CloseKind, PeerSession
from kvpeer.session.ports import Parent
from kvpeer.transport.base import ControlTransport, NodeDataPlane
from kvpeer.types import (
    JobResult,
    Key,
    LookupResult,
    OffloadPolicy,
    RequestContext,
    TransferJob,
)

__all__ = ["Tier", "TierStatistics"]

log = logging.getLogger("kvpeer.tier")


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
        self._requests = OpenRequests()
        self._engine = EngineWindows(config.engine_wait_s, lambda: len(self._requests) > 0)
        self._peers = PeerTable(
            config,
            control,
            data_plane,
            self._counters,
            pulled_from=self._requests.pulled_from,  # eviction spares their sessions
            hash_seed=hash_seed,
            boot_id=boot_id,
            trace=self._trace,
            held=held,
            engine=self._engine,
        )
        self._bindings = Bindings(
            self._peers,
            self._counters,
            unbound_store_timeout_s=config.unbound_store_timeout_s,
            tombstone_retention_s=config.tombstone_retention_s,
            early_fetch_ttl_s=config.load_timeout_s + config.abort_ack_timeout_s,
        )
        self._block_len: int | None = None
        self._shut_down = False
        self._steps = 0  # on_schedule_end calls: the engine's scheduler steps
        self._waits = PullWaits(config.max_peers)  # sources the engine may wait for
        self._ahead = PullAhead(config, self._counters, control.local_id)
        self._out = Outcomes(self._peers, self._requests, self._bindings, self._ahead,
                             self._counters, self._trace, lambda: self.block_len)  # fmt: skip
        self._lookups = Lookups(self._peers, self._requests, self._ahead, self._waits,
                                self._counters, self._trace)  # fmt: skip
        self._prefetcher = Prefetcher(self._peers, self._requests, self._ahead, self._out,
                                      self._counters, self._trace)  # fmt: skip

    # -- pulling ahead (kvpeer.node.ahead) -------------------------------------------

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
        self._out.results.extend(self._ahead.clear())
        return self._ahead.rows

    def staged_state(
        self, keys: Sequence[Key], request: RequestContext | None = None
    ) -> bool | None:
        """Pulled ahead: every key staged (True), some still being fetched from
        ``request``'s source (False), or not (None) (:meth:`PullAhead.state`)."""
        source = self._requests.source(request.req_id) if request is not None else None
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
            source = self._requests.source(request.req_id)
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
        elif source is not None and self._out.open(source.peer_id, now) is None:
            log.warning(
                "request %s: peer %s refused (allow-list or peer cap); computing locally",
                request.req_id,
                source.peer_id,
            )
            routing = Routing(None, routing.destination, routing.problems)
            source = None
        self._requests.open(request.req_id, routing)
        self._engine.opened(now, first=len(self._requests) == 1)
        if source is not None and backed_off:
            self._requests.fail(source.kv_request_id)  # MISS at once (peertable invariant 7)
        destination = routing.destination
        if destination is None:
            return OffloadPolicy.CHUNK_LEVEL
        self._out.results.extend(
            self._bindings.producer_started(destination.kv_request_id, request.req_id, now)
        )
        return OffloadPolicy.REQUEST_LEVEL

    def lookup(self, key: Key, request: RequestContext) -> LookupResult:
        return self._lookups.answer(key, request, self._clock(), self._steps)

    def pull_confirmed(self, request: RequestContext) -> bool:
        """Whether a load of ``request`` is worth waiting for on the engine thread
        (:meth:`kvpeer.node.lookups.Lookups.pull_confirmed`, invariant 7)."""
        return self._lookups.pull_confirmed(request, self._clock())

    def promotion_waited(self, request: RequestContext, waited_s: float, done: bool) -> None:
        """The engine waited ``waited_s`` in a lookup for a load it submitted at once;
        ``done``: it landed. What it means for later waits is
        :mod:`kvpeer.node.pullwaits`' (invariant 7)."""
        self._lookups.promotion_waited(request, waited_s, done, self._clock(), self._steps)

    def submit_load(self, job: TransferJob) -> None:
        now = self._clock()
        source = self._requests.source(job.request.req_id)
        staged = (
            self._ahead.take(job, now, source.peer_id if source else None,
                             give_up_s=source.give_up_s if source else None)
            if source is None or source.probe
            else None
        )
        if staged is not None:  # every key staged or being fetched ahead
            self._out.results.extend(staged)
            return
        if source is None or self._shut_down:
            self._out.results.append(JobResult(job.job_id, False))
            return
        if not job.keys:
            self._out.results.append(JobResult(job.job_id, True))
            return
        peer = self._peers.get(source.peer_id)
        if peer is None or not peer.session.alive or self._requests.failed(source.kv_request_id):
            self._out.results.append(JobResult(job.job_id, False))
            self._requests.fail(source.kv_request_id)
            return
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
            self._out.results.append(JobResult(job.job_id, False))
            self._requests.fail(source.kv_request_id)

    def submit_store(self, job: TransferJob) -> None:
        if self._held is not None and not self._shut_down:
            self._held.keep(job.keys, job.slots)  # before the job can be reported (inv. 6)
        destination = self._requests.routing(job.request.req_id).destination
        if destination is None:
            self._out.results.append(JobResult(job.job_id, True))  # nobody will fetch it
            return
        if self._shut_down:
            self._out.results.append(JobResult(job.job_id, False))
            return
        stored = self._bindings.store(destination.kv_request_id, job, self._clock())
        self._out.results.extend(stored)

    def get_finished_jobs(self) -> list[JobResult]:
        """Poll, then every job result not reported yet."""
        self.poll()
        return self.take_results()

    def take_results(self) -> list[JobResult]:
        """Every job result not reported yet, without polling (a driver polls)."""
        results, self._out.results = self._out.results, []
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
        unreleased, self._out.unreleased = self._out.unreleased, []
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
        return bool(self._out.results)

    def fail_job(self, job_id: int) -> None:
        """Report a job the tier could not take (e.g. after a driver crash) as failed."""
        self._out.results.append(JobResult(job_id, False))

    def has_transfers(self) -> bool:
        """Loads or writes in flight that may still touch the primary region."""
        return any(p.session.has_transfers() for p in self._peers)

    def needs_serve(self) -> bool:
        """Peer work waits for a serve window (an idle engine should step)."""
        return bool(self._out.unreleased) or any(p.session.needs_serve() for p in self._peers)

    def on_schedule_end(self) -> None:
        self._steps += 1  # the engine's scheduler steps (trace lines carry it)
        self._engine.window(self._clock())  # its serve window just ran (enginewait)
        for peer in self._peers:
            peer.session.flush_lookups()

    def on_request_finished(self, request: RequestContext) -> None:
        self._ahead.forget(request.req_id)
        routing, last_puller = self._requests.close(request.req_id)
        now = self._clock()
        source = routing.source
        if source is not None:
            if self._trace.enabled:
                self._trace.forget(source.kv_request_id, source.peer_id, self._steps)
            peer = self._peers.get(source.peer_id) if last_puller else None  # invariant 3
            if peer is not None:
                peer.session.finish_consumer(source.kv_request_id, now)
        destination = routing.destination
        if destination is not None:
            self._bindings.producer_finished(destination.kv_request_id, request.req_id, now)

    def has_pending_work(self) -> bool:
        return bool(self._out.results or self._out.unreleased) or any(
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
        self._out.apply(self._peers.close_all("tier shutting down", now), now)
        self._out.results.extend(self._bindings.fail_parked())
        self._out.results.extend(self._ahead.shutdown())
        self._control.close()
        self._data.close()
        if self._held is not None:
            self._held.close()  # after the planes: nothing reads a held row any more
        self._shut_down = True

    # -- statistics --------------------------------------------------------------

    def statistics(self) -> TierStatistics:
        return gather(
            live=[peer.session.statistics() for peer in self._peers],
            retired_stale_frames=self._counters.retired_stale_frames,
            table=self._peers.statistics(),
            bindings=self._bindings.statistics(),
            held=self._held.statistics() if self._held is not None else None,
            staging=self._ahead.statistics(),
            requests=self._requests,
            results_pending=len(self._out.results),
            blocks_loaded=self._out.blocks_loaded,
            ended=self._out.ended,
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
        return self._counters.snapshot(
            (peer.session.statistics() for peer in self._peers),
            self._out.ended[CloseKind.TIMEOUT.value],
        )

    def peers(self, limit: int = 256) -> tuple[list[PeerView], int]:
        """At most ``limit`` peers as an operator sees them, and how many there are
        (under the node's lock, like :meth:`statistics`)."""
        return self._peers.view(self._clock(), limit)

    @property
    def steps(self) -> int:
        """The engine's scheduler steps so far (``on_schedule_end`` calls)."""
        return self._steps

    @property
    def blocks_loaded(self) -> int:
        """Blocks successful loads brought from peers since start (one int: safe to
        read from any thread, unlike :meth:`statistics`)."""
        return self._out.blocks_loaded

    @property
    def load_seconds(self) -> float:
        """Seconds successful loads took, fetch to completion, summed (like
        :attr:`blocks_loaded`, readable from any thread)."""
        return self._out.load_seconds

    @property
    def block_len(self) -> int:
        """Bytes of one block of the primary region (what one block moves)."""
        if self._block_len is None:
            self._block_len = self._data.describe().block_len
        return self._block_len

    @property
    def engine_wait_s(self) -> float | None:
        """How long a peer's lookup held blocks cannot answer waits for the engine at
        most (``engine_wait_s``; None: for its step, :mod:`kvpeer.node.enginewait`)."""
        return self._config.engine_wait_s

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
            self._out.apply(self._peers.route(inbound, now), now)
        for inbound, prefetch in self._peers.take_prefetches():
            self._prefetcher.prefetch(inbound, prefetch, now)
        for polled in self._peers.poll(now):
            self._out.apply_one(polled, now)
        self._out.results.extend(self._bindings.expire(now))
        self._ahead.expire(now)
        self._out.results.extend(self._ahead.give_up(now))
        self._peers.expire(now)
        for peer in self._peers:  # peer work reached us: its wait for a step starts
            if peer.serve_wait_since is None and peer.session.needs_serve():
                peer.serve_wait_since = now
        self._control.flush()  # what this tick queued goes out now, not next loop
