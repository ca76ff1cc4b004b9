"""The engine-facing tier: one :class:`PeerSession` per peer, binding, parking, reaping.

Invariants:

1. Every job the engine submits is reported exactly once by
   :meth:`Tier.get_finished_jobs` (or immediately queued when there is
   nothing to do for it).
2. A consumer request answers MISS from the moment its load failed, its peer
   died or its probes timed out, until it finishes (``_failed`` holds only ids
   of live consumer requests).
3. Producer stores for a ``remote_decoder`` id are parked until a fetch for
   the id arrives on some session, then bound to it. Parked stores older than
   ``unbound_store_timeout_s`` fail and the id is tombstoned for
   ``tombstone_retention_s``: a fetch for it is rejected in the same tick,
   a store for it fails at once. Tombstones expire.
4. A fetch for an id with no producer state yet (decoder first) is
   remembered until the consumer's load would have timed out, so the stores
   that follow still find it.
5. No collection grows with the number of requests ever served: per-request
   entries leave at ``on_request_finished``, everything else expires.
6. A dead session is reaped within one poll: its loads and stores fail, its
   waiting probes answer MISS, its serve requests are released at the next
   serve window.
7. Only a peer's ``connect`` opens a session; other frames from a peer with no
   live session are stragglers of an ended one and are dropped (counted). Once
   the session ended ``peer_wait_s`` ago or more (stragglers in flight have
   arrived by then), a peer still sending into it holds a session we forgot -
   its goodbye was lost, e.g. in a partition that healed between the two ends'
   heartbeat timeouts - and would wait out the timeouts of every request it
   sends: it gets a ``disconnect`` on its own connection (never a dial).
8. A session that ended because our link to the peer broke says goodbye on a
   fresh link (best effort, once): the peer's link to us may still work, and a
   vLLM peer, which never reads answers on its own connection, would otherwise
   keep the session, wait out each load it sends us and take our next
   ``connect`` for a duplicate.
9. A peer's ``connect`` identical to one we refused within ``handshake_timeout_s``
   is refused on the peer's own connection without opening a session: a vLLM peer
   answers our goodbye with a new session and the same ``connect``, and opening
   a session for it (our ``connect``, then our goodbye) would loop.
10. Nothing a peer names is dialed blindly, ourselves least of all (frames under
    our own identity are dropped). A session an inbound peer opens is
    dialed back at the identity it claims only if that identity's host is the
    IP address its connection comes from (unless ``trust_peer_addresses``).
    A session is bound to the first address its peer's frames came from;
    frames under its identity from elsewhere are dropped.
11. One source address holds at most ``max_handshakes_per_source`` sessions
    still in their handshake; a connect beyond that is refused, and eviction
    takes handshaking sessions of the busiest source first, so one address
    cannot flood everyone else out.
12. A peer whose session ended unreachable (or timed out) before it ever
    acknowledged us is backed off: requests naming it compute locally at once
    until its retry time, which doubles from :data:`FIRST_RETRY_S` up to
    ``peer_retry_max_s`` with each failed attempt; the first session that
    completes its handshake clears it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpeer.config import TierConfig
from kvpeer.errors import PeerLost, ProtocolError
from kvpeer.node.counters import CounterSnapshot, TierCounters
from kvpeer.node.params import LOCAL, Routing, parse_transfer_params, split_peer_id
from kvpeer.protocol import PROTOCOL_VERSION, Codec, Connect, ConnectExtension, Disconnect
from kvpeer.session import CloseKind, PeerSession, PollResult
from kvpeer.session.ports import Parent
from kvpeer.session.worklist import WorkMap
from kvpeer.transport.base import ControlLink, ControlTransport, InboundFrame, NodeDataPlane
from kvpeer.types import (
    JobResult,
    Key,
    LookupResult,
    OffloadPolicy,
    RequestContext,
    ServeRequest,
    StoreJob,
    TransferJob,
)

__all__ = ["Tier", "TierStatistics"]

log = logging.getLogger("kvpeer.tier")

DEFAULT_HASH_SEED = "vllm-none-hash"
#: The first back-off after a peer could not be reached (invariant 12).
FIRST_RETRY_S = 1.0


@dataclass(slots=True)
class _Peer:
    session: PeerSession
    link: ControlLink
    last_used: float
    #: The address the peer's frames come from, once one arrived (invariant 10).
    source: str | None = None


@dataclass(slots=True)
class _Parked:
    since: float
    jobs: list[TransferJob] = field(default_factory=list)


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
    stray_frames: int
    blocks_loaded: int  # since start: blocks successful loads brought from peers
    #: since start: sessions ended, by :class:`CloseKind` value
    sessions_ended: dict[str, int] = field(default_factory=dict)


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
    ) -> None:
        """``hash_seed`` may be a callable: resolved when the first session opens
        (vLLM knows its prefix-hash seed only after the tier was built)."""
        self._config = config
        self._settings = config.session_settings()
        self._control = control
        self._data = data_plane
        self._clock = clock
        self._sleep = sleep
        self._hash_seed_source = config.hash_seed or hash_seed or DEFAULT_HASH_SEED
        self._hash_seed: str | None = None
        self._boot_id = boot_id or os.urandom(16)
        self._peers: dict[str, _Peer] = {}
        self._requests: dict[str, Routing] = {}
        self._consumer_refs: dict[str, int] = {}
        self._failed: set[str] = set()
        self._producers: dict[str, str] = {}  # kv_request_id -> req_id
        self._bindings: dict[str, str] = {}  # kv_request_id -> peer_id
        self._parked: WorkMap[str, _Parked] = WorkMap()  # insertion order == age order
        self._tombstones: WorkMap[str, float] = WorkMap()  # id -> expiry, age order
        self._early_fetches: WorkMap[str, tuple[str, float]] = WorkMap()  # id -> (peer, expiry)
        self._results: list[JobResult] = []
        self._unreleased: list[ServeRequest] = []
        self._refused = 0
        self._stray = 0  # frames from peers without a live session (not a connect)
        # peer -> (digest of the connect we refused, when that stops counting, why)
        self._refused_hellos: dict[str, tuple[bytes, float, str]] = {}
        self._blocks_loaded = 0
        self._load_seconds = 0.0
        self._ended: Counter[str] = Counter()
        self._counters = TierCounters()
        self._block_len: int | None = None
        # peer -> (no new session before this time, the back-off that set it)
        self._backoff: dict[str, tuple[float, float]] = {}
        # peer -> when its last session ended, oldest first (invariant 7)
        self._sessions_ended_at: dict[str, float] = {}
        self._codec = Codec()
        self._shut_down = False
        #: True while a driver thread calls :meth:`poll`; engine calls then never
        #: receive (frames they produce leave through the control transport at once).
        self.driven = False

    # -- SecondaryTier -----------------------------------------------------------

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        if self._shut_down:
            return OffloadPolicy.CHUNK_LEVEL
        routing = parse_transfer_params(request.kv_transfer_params)
        for problem in routing.problems:
            log.warning("request %s runs locally for that role: %s", request.req_id, problem)
        now = self._clock()
        source = routing.source
        backed_off = source is not None and self._backed_off(source.peer_id, now)
        if backed_off:
            log.info(
                "request %s: peer %s was unreachable a moment ago; computing locally",
                request.req_id,
                source.peer_id if source is not None else "",
            )
        elif source is not None and self._peer(source.peer_id, now) is None:
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
            if backed_off:
                self._fail_id(source.kv_request_id)  # MISS at once (invariant 12)
        destination = routing.destination
        if destination is None:
            return OffloadPolicy.CHUNK_LEVEL
        self._producers[destination.kv_request_id] = request.req_id
        self._bind_early_fetch(destination.kv_request_id, now)
        return OffloadPolicy.REQUEST_LEVEL

    def lookup(self, key: Key, request: RequestContext) -> LookupResult:
        result = self._lookup(key, request)
        self._counters.lookups[result.name] += 1
        return result

    def _lookup(self, key: Key, request: RequestContext) -> LookupResult:
        source = self._requests.get(request.req_id, LOCAL).source
        if source is None or source.kv_request_id in self._failed:
            return LookupResult.MISS
        if not source.probe:
            return LookupResult.HIT  # PD: the prefiller will have every block
        peer = self._peers.get(source.peer_id)
        if peer is None or not peer.session.alive:
            return LookupResult.MISS
        now = self._clock()
        peer.last_used = now
        answer = peer.session.register_probe(source.kv_request_id, key, now)
        if answer is None:
            return LookupResult.RETRY
        return LookupResult.HIT if answer else LookupResult.MISS

    def submit_load(self, job: TransferJob) -> None:
        source = self._requests.get(job.request.req_id, LOCAL).source
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
        try:
            peer.session.request_blocks(job.job_id, source.kv_request_id, job.keys, job.slots, now)
        except ProtocolError as exc:
            log.error("load %s of request %s refused: %s", job.job_id, job.request.req_id, exc)
            self._results.append(JobResult(job.job_id, False))
            self._fail_id(source.kv_request_id)

    def submit_store(self, job: TransferJob) -> None:
        destination = self._requests.get(job.request.req_id, LOCAL).destination
        if destination is None:
            self._results.append(JobResult(job.job_id, True))  # nobody will fetch it
            return
        kv_request_id = destination.kv_request_id
        if kv_request_id in self._tombstones or self._shut_down:
            self._results.append(JobResult(job.job_id, False))
            return
        now = self._clock()
        peer_id = self._bindings.get(kv_request_id)
        if peer_id is not None and self._supply(peer_id, kv_request_id, job, now):
            return
        parked = self._parked.get(kv_request_id)
        if parked is None:
            parked = self._parked[kv_request_id] = _Parked(now)
        parked.jobs.append(job)
        self._bind_early_fetch(kv_request_id, now)

    def get_finished_jobs(self) -> list[JobResult]:
        if not self._shut_down and not self.driven:
            self._tick(self._clock())
        results, self._results = self._results, []
        return results

    def poll(self) -> None:
        """Receive, run timers and completions (the driver thread calls this)."""
        if not self._shut_down:
            self._tick(self._clock())

    def next_deadline(self) -> float | None:
        """When :meth:`poll` is next due for a timer (frames wake it anyway)."""
        deadlines = [
            d for p in self._peers.values() if (d := p.session.next_deadline()) is not None
        ]
        if (oldest := self._parked.first()) is not None:
            deadlines.append(oldest[1].since + self._config.unbound_store_timeout_s)
        if (tombstone := self._tombstones.first()) is not None:
            deadlines.append(tombstone[1])
        if (early := self._early_fetches.first()) is not None:
            deadlines.append(early[1][1])
        return min(deadlines, default=None)

    def serve_external_requests(self, parent: Parent) -> None:
        unreleased, self._unreleased = self._unreleased, []
        for serve in unreleased:
            parent.on_request_finished(serve)
        now = self._clock()
        for peer in list(self._peers.values()):
            if peer.session.needs_serve():
                peer.session.serve(parent, now)

    def has_results(self) -> bool:
        return bool(self._results)

    def fail_job(self, job_id: int) -> None:
        """Report a job the tier could not take (e.g. after a driver crash) as failed."""
        self._results.append(JobResult(job_id, False))

    def has_transfers(self) -> bool:
        """Loads or writes in flight that may still touch the primary region."""
        return any(p.session.has_transfers() for p in self._peers.values())

    def needs_serve(self) -> bool:
        """Peer work waits for a serve window (an idle engine should step)."""
        return bool(self._unreleased) or any(p.session.needs_serve() for p in self._peers.values())

    def on_schedule_end(self) -> None:
        for peer in self._peers.values():
            peer.session.flush_lookups()

    def on_request_finished(self, request: RequestContext) -> None:
        routing = self._requests.pop(request.req_id, LOCAL)
        now = self._clock()
        source = routing.source
        if source is not None:
            kv_request_id = source.kv_request_id
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
            kv_request_id = destination.kv_request_id
            if self._producers.get(kv_request_id) == request.req_id:
                del self._producers[kv_request_id]
            peer_id = self._bindings.pop(kv_request_id, None)
            bound = self._peers.get(peer_id) if peer_id is not None else None
            if bound is not None:
                bound.session.finish_supply(kv_request_id, now)
            # Unbound: parked stores wait for the fetch; binding then sees no live
            # producer and tells the session its supply is complete.

    def has_pending_work(self) -> bool:
        return bool(self._results or self._unreleased) or any(
            peer.session.has_work() for peer in self._peers.values()
        )

    def drain_jobs(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until no transfer touches the primary region."""
        deadline = self._clock() + timeout_s
        while True:
            self._tick(self._clock())
            busy = [p for p in self._peers.values() if p.session.has_work()]
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
        for peer_id, peer in list(self._peers.items()):
            peer.session.close("tier shutting down")
            self._handle(peer_id, peer, peer.session.poll(now))
        for parked in self._parked.values():
            self._results.extend(JobResult(job.job_id, False) for job in parked.jobs)
        self._parked.clear()
        self._control.close()
        self._data.close()
        self._shut_down = True

    # -- statistics --------------------------------------------------------------

    def statistics(self) -> TierStatistics:
        loads = transfers = pins = 0
        for peer in self._peers.values():
            stats = peer.session.statistics()
            loads += stats.consumer.loads_in_flight
            transfers += stats.producer.transfers_in_flight
            pins += stats.producer.pinned_blocks
        return TierStatistics(
            sessions=len(self._peers),
            requests=len(self._requests),
            consumer_ids=len(self._consumer_refs),
            producer_ids=len(self._producers),
            failed_ids=len(self._failed),
            bound_ids=len(self._bindings),
            parked_ids=len(self._parked),
            parked_batches=sum(len(p.jobs) for p in self._parked.values()),
            tombstones=len(self._tombstones),
            early_fetches=len(self._early_fetches),
            loads_in_flight=loads,
            transfers_in_flight=transfers,
            pinned_blocks=pins,
            results_pending=len(self._results),
            peers_refused=self._refused,
            stray_frames=self._stray,
            blocks_loaded=self._blocks_loaded,
            sessions_ended=dict(self._ended),
        )

    def counters(self) -> CounterSnapshot:
        """Since-start event counts and histograms, live sessions included
        (under the node's lock, like :meth:`statistics`)."""
        c = self._counters
        served, unknown = c.retired_blocks_served, c.retired_unknown_messages
        timeouts: Counter[str] = Counter()
        timeouts.update(c.retired_timeouts)
        timeouts.update(c.timeouts)
        for peer in self._peers.values():
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
        )

    def _retire(self, session: PeerSession) -> None:
        """Keep what an ending session counted (counters invariant 3)."""
        stats = session.statistics()
        c = self._counters
        c.retired_blocks_served += stats.producer.blocks_written
        c.retired_unknown_messages += stats.unknown_messages
        c.retired_timeouts.update(stats.consumer.timeouts)
        c.retired_timeouts.update(stats.producer.timeouts)

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
            self._route(inbound, now)
        for peer_id, peer in list(self._peers.items()):
            if not peer.link.alive and peer.session.alive:
                peer.session.close("control link lost", CloseKind.UNREACHABLE)
            self._handle(peer_id, peer, peer.session.poll(now))
        self._reap_parked(now)
        self._expire(now)
        self._control.flush()  # what this tick queued goes out now, not next loop

    def _route(self, inbound: InboundFrame, now: float) -> None:
        peer_id, frame = inbound.peer_id, inbound.frame
        if peer_id == self._control.local_id:
            self._stray += 1  # someone using our own identity: never a session with us
            return
        source = _canonical_ip(inbound.source)
        if source is not None and not self._config.allowed_peers.allows_source(source):
            self._refused += 1
            self._refuse(peer_id, frame, f"connections from {source} are not in allowed_peers")
            return
        peer = self._peers.get(peer_id)
        if peer is not None and peer.session.alive and source is not None:
            if peer.source is None:
                peer.source = source
            elif peer.source != source:
                self._stray += 1  # someone else claiming a live peer's identity
                log.warning(
                    "dropped a frame claiming to be %s from %s (its session is with %s)",
                    peer_id,
                    source,
                    peer.source,
                )
                return
        if peer is None or not peer.session.alive:
            # Only a peer's connect opens a session. Anything else from a peer we
            # hold no live session with is a straggler of a session that ended (its
            # goodbye is on the way): answering it with a new session would make both
            # sides open and fail sessions in a loop.
            if not self._opens_session(frame):
                self._stray += 1
                ended = self._sessions_ended_at.get(peer_id)
                if ended is not None and now >= ended + self._config.peer_wait_s:
                    self._refuse(peer_id, frame, "no session with you (it ended)", quiet=True)
                return
            refused = self._refused_hellos.get(peer_id)
            if refused is not None and refused[0] == _digest(frame) and now < refused[1]:
                self._refused += 1
                self._refuse(peer_id, frame, f"{refused[2]} (this connect was refused before)")
                return
            problem = self._inbound_problem(peer_id, source)
            if problem is not None:
                self._refused += 1
                self._refuse(peer_id, frame, problem)
                return
            peer = self._peer(peer_id, now, source)
            if peer is None:
                self._refuse(peer_id, frame, "peer not allowed, or the peer cap is reached")
                return
        peer.last_used = now
        peer.session.receive(frame, now)
        if not peer.session.alive:
            result = peer.session.poll(now)
            self._handle(peer_id, peer, result)
            closed = result.closed
            if closed is not None and closed.kind is CloseKind.REJECTED:
                self._remember_refusal(peer_id, frame, closed.reason, now)
            if closed is not None and closed.kind is CloseKind.RESTARTED:
                log.info("peer %s restarted; opening a fresh session", peer_id)
                fresh = self._peer(peer_id, now, source)
                if fresh is not None:
                    fresh.session.receive(frame, now)

    def _handle(self, peer_id: str, peer: _Peer, result: PollResult) -> None:
        counters = self._counters
        for seconds in result.lookup_seconds:
            counters.lookup_seconds.observe(seconds)
        for load in result.loads:
            self._results.append(
                JobResult(
                    load.job_id,
                    load.success,
                    load.seconds if load.success else None,
                    load.blocks * self.block_len if load.success else None,
                )
            )
            self._blocks_loaded += load.blocks
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
                self._fail_id(load.kv_request_id)
        self._results.extend(JobResult(s.job_id, s.success) for s in result.stores)
        for kv_request_id in result.expired_probe_ids:
            log.info("lookups of %s at %s timed out; computing locally", kv_request_id, peer_id)
            self._fail_id(kv_request_id)
        for kv_request_id in result.fetched_ids:
            self._on_fetch(peer_id, peer, kv_request_id)
        closed = result.closed
        if closed is None:
            return
        self._ended[closed.kind.value] += 1
        self._sessions_ended_at.pop(peer_id, None)
        self._sessions_ended_at[peer_id] = self._clock()
        while len(self._sessions_ended_at) > 4 * self._config.max_peers:  # bounded
            del self._sessions_ended_at[next(iter(self._sessions_ended_at))]
        counters.loads_failed += len(closed.loads)
        self._retire(peer.session)
        if closed.kind in (CloseKind.INTERNAL_ERROR, CloseKind.LOCAL_FAULT):
            log.error(
                "session %s ended (%s): %s",
                peer_id,
                closed.kind.value,
                closed.reason,
                exc_info=closed.error,
            )
        else:
            log.warning("session %s ended (%s): %s", peer_id, closed.kind.value, closed.reason)
        self._results.extend(JobResult(x.job_id, x.success) for x in closed.loads)
        self._results.extend(JobResult(x.job_id, x.success) for x in closed.stores)
        for kv_request_id in closed.failed_request_ids:
            self._fail_id(kv_request_id)
        # Every live request pulling from this peer computes locally from now on,
        # even if it had nothing in flight: its peer's answers died with the session.
        for routing in self._requests.values():
            if routing.source is not None and routing.source.peer_id == peer_id:
                self._fail_id(routing.source.kv_request_id)
        self._unreleased.extend(closed.unreleased_serves)
        for kv_request_id in [k for k, p in self._bindings.items() if p == peer_id]:
            del self._bindings[kv_request_id]
        for kv_request_id in [k for k, (p, _) in self._early_fetches.items() if p == peer_id]:
            del self._early_fetches[kv_request_id]
        if self._peers.get(peer_id) is peer:
            del self._peers[peer_id]
            self._data.revoke(peer_id)
        peer.link.close()
        unreachable = closed.kind in (CloseKind.UNREACHABLE, CloseKind.TIMEOUT)
        if unreachable and not peer.session.answered:
            self._back_off(peer_id, self._clock())  # and no goodbye: nobody to hear it
        elif closed.kind is CloseKind.UNREACHABLE:
            self._say_goodbye(peer_id, closed.reason)

    def _say_goodbye(self, peer_id: str, reason: str) -> None:
        """A ``disconnect`` on a fresh link to ``peer_id``, which then closes (its
        queued frame still goes out; see invariant 8)."""
        try:
            link = self._control.connect(peer_id)
        except PeerLost:
            return
        link.transmit(self._codec.encode(Disconnect(reason=f"session ended: {reason}")))
        link.close()

    # -- producer binding ------------------------------------------------------------

    def _on_fetch(self, peer_id: str, peer: _Peer, kv_request_id: str) -> None:
        now = self._clock()
        if kv_request_id in self._tombstones:
            self._counters.late_fetches_rejected += 1
            log.info(
                "late fetch for %s from %s rejected (stores were reaped)", kv_request_id, peer_id
            )
            peer.session.finish_supply(kv_request_id, now)
            return
        if kv_request_id in self._bindings:
            return
        if kv_request_id in self._parked or kv_request_id in self._producers:
            self._bind(kv_request_id, peer_id, peer, now)
        else:
            expiry = now + self._config.load_timeout_s + self._config.abort_ack_timeout_s
            self._early_fetches.pop(kv_request_id, None)
            self._early_fetches[kv_request_id] = (peer_id, expiry)

    def _bind_early_fetch(self, kv_request_id: str, now: float) -> None:
        early = self._early_fetches.pop(kv_request_id, None)
        if early is None:
            return
        peer = self._peers.get(early[0])
        if peer is not None and peer.session.alive:
            self._bind(kv_request_id, early[0], peer, now)

    def _bind(self, kv_request_id: str, peer_id: str, peer: _Peer, now: float) -> None:
        parked = self._parked.pop(kv_request_id, None)
        live = kv_request_id in self._producers
        if live:
            self._bindings[kv_request_id] = peer_id
        if parked is not None:
            for job in parked.jobs:
                if not self._supply(peer_id, kv_request_id, job, now):
                    self._results.append(JobResult(job.job_id, False))
        if not live:
            peer.session.finish_supply(kv_request_id, now)

    def _supply(self, peer_id: str, kv_request_id: str, job: TransferJob, now: float) -> bool:
        peer = self._peers.get(peer_id)
        if peer is None:
            return False
        peer.last_used = now
        return peer.session.add_supply(
            kv_request_id, StoreJob(job.job_id, job.keys, job.slots), now
        )

    # -- expiry ----------------------------------------------------------------------

    def _reap_parked(self, now: float) -> None:
        timeout = self._config.unbound_store_timeout_s
        while (oldest := self._parked.first()) is not None:
            kv_request_id, parked = oldest
            if now < parked.since + timeout:
                break
            del self._parked[kv_request_id]
            log.warning(
                "no fetch for %s within %gs: failing %d parked stores",
                kv_request_id,
                timeout,
                len(parked.jobs),
            )
            self._results.extend(JobResult(job.job_id, False) for job in parked.jobs)
            self._counters.stores_reaped += len(parked.jobs)
            self._counters.timeouts["unbound_store"] += 1
            self._tombstones.pop(kv_request_id, None)
            self._tombstones[kv_request_id] = now + self._config.tombstone_retention_s

    def _expire(self, now: float) -> None:
        """Drop tombstones and early fetches whose time is up (oldest first)."""
        while (tombstone := self._tombstones.first()) is not None:
            kv_request_id, expiry = tombstone
            if now < expiry:
                break
            del self._tombstones[kv_request_id]
        while (early := self._early_fetches.first()) is not None:
            kv_request_id, (_, expiry) = early
            if now < expiry:
                break
            del self._early_fetches[kv_request_id]
        while self._refused_hellos:  # in expiry order: one timeout for all of them
            peer_id, (_, expiry, _) = next(iter(self._refused_hellos.items()))
            if now < expiry:
                break
            del self._refused_hellos[peer_id]

    # -- sessions ----------------------------------------------------------------------

    def _remember_refusal(self, peer_id: str, frame: bytes, reason: str, now: float) -> None:
        """Invariant 9: ``frame`` (a connect) made us refuse ``peer_id``."""
        if not self._opens_session(frame):
            return
        self._refused_hellos.pop(peer_id, None)
        expiry = now + self._config.handshake_timeout_s
        self._refused_hellos[peer_id] = (_digest(frame), expiry, reason)
        while len(self._refused_hellos) > self._config.max_peers:
            del self._refused_hellos[next(iter(self._refused_hellos))]

    def _opens_session(self, frame: bytes) -> bool:
        try:
            return isinstance(self._codec.decode(frame), Connect)
        except ProtocolError:
            return False

    def _refuse(self, peer_id: str, frame: bytes, reason: str, *, quiet: bool = False) -> None:
        """Tell a peer we will not talk to it, on its own connection (never dial it)."""
        try:
            if isinstance(self._codec.decode(frame), Disconnect):
                return  # never answer a goodbye: two refusing nodes would ping-pong
        except ProtocolError:
            pass
        if not quiet:
            log.warning("refusing %s: %s", peer_id, reason)
        self._control.refuse(peer_id, self._codec.encode(Disconnect(reason=reason)))

    def _fail_id(self, kv_request_id: str) -> None:
        if kv_request_id in self._consumer_refs:
            self._failed.add(kv_request_id)

    def _backed_off(self, peer_id: str, now: float) -> bool:
        """Invariant 12: no new session toward ``peer_id`` yet."""
        entry = self._backoff.get(peer_id)
        if entry is None:
            return False
        peer = self._peers.get(peer_id)
        if peer is not None and peer.session.answered:
            del self._backoff[peer_id]  # it came back
            return False
        return now < entry[0]

    def _back_off(self, peer_id: str, now: float) -> None:
        previous = self._backoff.pop(peer_id, None)
        delay = FIRST_RETRY_S if previous is None else previous[1] * 2
        delay = min(delay, self._config.peer_retry_max_s)
        self._backoff[peer_id] = (now + delay, delay)
        log.info("peer %s unreachable: no new session toward it for %gs", peer_id, delay)
        while len(self._backoff) > 4 * self._config.max_peers:  # bounded, oldest first
            del self._backoff[next(iter(self._backoff))]

    def _inbound_problem(self, peer_id: str, source: str | None) -> str | None:
        """Why an inbound peer may not open a session (invariants 10 and 11), or None."""
        if source is None:
            return None  # a transport that cannot tell (in-memory): nothing to compare
        if not self._config.trust_peer_addresses:
            address = split_peer_id(peer_id)
            claimed = _canonical_ip(address[0]) if address is not None else None
            if claimed != source:
                return (
                    f"peer id {peer_id!r} does not name the address its connection comes "
                    f"from ({source}); set trust_peer_addresses for peers behind NAT"
                )
        handshaking = sum(
            1 for p in self._peers.values() if p.source == source and not p.session.ready
        )
        if handshaking >= self._config.max_handshakes_per_source:
            return (
                f"{source} already has {handshaking} sessions in their handshake "
                f"(max_handshakes_per_source)"
            )
        return None

    def _peer(self, peer_id: str, now: float, source: str | None = None) -> _Peer | None:
        """The live session toward ``peer_id``, opened if allowed and room permits."""
        peer = self._peers.get(peer_id)
        if peer is not None:
            if peer.session.alive:
                return peer
            self._handle(peer_id, peer, peer.session.poll(now))  # reap the dead one first
        address = split_peer_id(peer_id)
        if (
            address is None
            or peer_id == self._control.local_id
            or not self._config.allowed_peers.allows(*address)
        ):
            self._refused += 1
            return None
        if len(self._peers) >= self._config.max_peers and not self._evict_idle(now):
            self._refused += 1
            return None
        link = self._control.connect(peer_id)
        self._data.grant(peer_id)
        session = PeerSession(peer_id, self._hello(), self._data, link.transmit, self._settings)
        peer = _Peer(session, link, now, source)
        self._peers[peer_id] = peer
        self._counters.sessions_opened += 1
        session.start(now)
        return peer

    def _evict_idle(self, now: float) -> bool:
        # Sessions still in their handshake go first, then the least recently used;
        # never one with work in flight, nor a ready one a live request pulls from.
        # Among handshaking ones, those of the source holding the most go first.
        needed = {r.source.peer_id for r in self._requests.values() if r.source is not None}
        crowd = Counter(p.source for p in self._peers.values() if not p.session.ready)
        idle = [
            (peer.session.ready, -crowd[peer.source], peer.last_used, peer_id)
            for peer_id, peer in self._peers.items()
            if not peer.session.has_work() and not (peer.session.ready and peer_id in needed)
        ]
        if not idle:
            return False
        *_, peer_id = min(idle)
        peer = self._peers[peer_id]
        peer.session.close("evicted: idle and the peer cap was reached")
        self._handle(peer_id, peer, peer.session.poll(now))
        return True

    def _resolved_hash_seed(self) -> str:
        if self._hash_seed is None:
            source = self._hash_seed_source
            self._hash_seed = source if isinstance(source, str) else source()
        return self._hash_seed

    def _hello(self) -> Connect:
        region = self._data.describe()
        return Connect(
            peer_id=self._control.local_id,
            agent_metadata=region.agent_metadata,
            base_addr=region.base_addr,
            num_blocks=region.num_blocks,
            block_len=region.block_len,
            hash_seed=self._resolved_hash_seed(),
            config_fingerprint=self._config.config_fingerprint,
            kvpeer=ConnectExtension(
                version=PROTOCOL_VERSION,
                boot_id=self._boot_id,
                transports={
                    name: offer
                    for name, offer in region.offers.items()
                    if name in self._config.data_transports
                },
            ),
        )


def _canonical_ip(text: str | None) -> str | None:
    """``text`` as a canonical IP string (IPv4-mapped IPv6 as IPv4, no brackets),
    or None when it is not an IP literal."""
    if text is None:
        return None
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _digest(frame: bytes) -> bytes:
    return hashlib.blake2b(frame, digest_size=16).digest()
