"""Producer role: serving our pinned blocks to one peer. Sans-IO.

The role matches a peer's fetches with pinned supply and writes it; the
lookups it owes an answer are :mod:`kvpeer.session.producer_lookups`', what it
keeps per peer (and the peer's budget) :mod:`kvpeer.session.producer_state`'s.

Invariants (per ``kv_request_id``):

1. Inbound lookups are resolved only inside a serve window (the parent is
   valid only there). Per pass, a lookup's HIT keys are pinned with one store
   job and become *round supply* of the lookup's round; MISS answers false;
   HIT_PENDING/RETRY keys are asked again each pass until
   ``lookup_pending_timeout_s`` after arrival, then answer false.
2. Each lookup gets exactly one ``lookup_resp`` (keys in wire order), unless
   the consumer closed its round first (a fetch for that round or a terminal
   fetch): then it gets none. The parent sees ``on_request_finished`` once
   for every ``on_new_request``.
3. Stores bound to this session by the tier are *pool supply*: they serve
   whichever round of the id demands them (PD may fetch in several rounds).
4. A fetch is the demand of one round; a second fetch for a round that has
   demand is a protocol error. Demand is matched against the round's supply,
   then the pool. A round with lookup state fails at once if any demanded key
   was not pinned; a PD round waits for stores until the producer's request
   finished (``finish_supply``), then fails. A *resolve* fetch (kvpeer 1.2)
   brings its own lookup of the demanded keys, resolved like any lookup of its
   round (invariant 1) but answered only by the round's reply; its round fails
   once that lookup is done if any demanded key was not pinned.
5. Rounds finish, fail and abort independently. A failing or aborted round
   replies (``transfer_done(false)`` / ``abort_ack``) only once none of its
   writes can still touch the consumer's memory: in-flight writes are
   cancelled and drained for up to ``abort_drain_timeout_s``.
6. A write running longer than ``transfer_timeout_s`` (the consumer has given
   up on it by then) fails its round like any failed write.
7. Every store job is reported exactly once, when its last key is settled
   (written, released unused, failed, or timed out); it fails if any of its
   keys failed or timed out. Supply nobody fetched within ``store_timeout_s``
   of being pinned or bound is released.
8. What the peer makes us hold - queued lookups, the demand of its fetches,
   one entry per ``kv_request_id`` it named - is charged in bytes against
   ``max_peer_bytes``; a lookup or fetch that would go over raises
   :class:`~kvpeer.errors.BudgetExceeded` (the session ends).
9. With a :class:`~kvpeer.session.ports.HeldSupply` (the node's held blocks,
   ``kvpeer.node.held``), a lookup whose keys are all held is answered at once,
   on arrival, every key a hit: they are pinned as its round's supply, without
   the parent or a serve window. A resolve fetch whose demanded keys are all
   held is matched the same way, without its lookup. Held supply is a pinned
   job of its own that is never reported to the engine: settling it unpins
   its slots (once each) instead. Anything else goes the way of invariant 1.
10. With :class:`~kvpeer.session.ports.EngineSteps` (the node's view of its
    engine's steps, ``engine_wait_s``), a queued lookup still unanswered at its
    ``answer_by`` is answered then, without a window: keys pinned by an earlier
    window stay hits, and so does the longest run of the others before its first
    miss that held blocks hold then (pinned as with invariant 9); the rest are
    misses; a resolve fetch's lookup fails its round
    (invariant 4's "not pinned"). Invariant 2 holds: one answer per lookup, and the
    serve request it opened is finished in the next window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvpeer.errors import BudgetExceeded, DataPlaneError, ProtocolError
from kvpeer.protocol import (
    AbortAck,
    AbortFetch,
    Fetch,
    Lookup,
    Message,
    TransferDone,
)
from kvpeer.session.ports import DataPlane, EngineSteps, HeldSupply, Parent
from kvpeer.session.producer_lookups import InboundLookups
from kvpeer.session.producer_state import (
    ANSWER_SHARE,
    LOOKUP_BYTES,
    MAX_QUEUED_LOOKUP_KEYS,
    ROUND_BYTES,
    PeerBudget,
    PinnedJob,
    ProducerRequest,
    ProducerStatistics,
    Round,
    Supply,
    SupplyState,
    Transfer,
    keys_cost,
)
from kvpeer.session.results import StoreFinished
from kvpeer.session.settings import SessionSettings
from kvpeer.session.worklist import WorkMap, WorkSet
from kvpeer.types import Key, ServeRequest, StoreJob

__all__ = ["MAX_QUEUED_LOOKUP_KEYS", "ProducerRole", "ProducerStatistics"]


class ProducerRole:
    """Serves a peer's lookups and fetches out of our pinned primary slots."""

    def __init__(
        self,
        peer_id: str,
        send: Callable[[Message], None],
        data_plane: DataPlane,
        settings: SessionSettings,
        held: HeldSupply | None = None,
        engine: EngineSteps | None = None,
    ) -> None:
        self._peer_id = peer_id
        self._held_supply = held
        self._held_jobs = 0  # ids of held supply's jobs: negative, never the engine's
        self._send = send
        self._data = data_plane
        self._settings = settings
        self._consumer_blocks: int | None = None
        self._requests: dict[str, ProducerRequest] = {}
        self._budget = PeerBudget(settings.max_peer_bytes, self._requests)
        self._timeouts: Counter[str] = Counter()
        self._lookups = InboundLookups(
            peer_id, send, settings, self._requests, self._budget, self._timeouts,
            pin=self.add_supply, unmet=self._check_unmet, prune=self._prune, engine=engine,
            pin_held=self._pin_held_prefix,
        )  # fmt: skip
        self._transfers: WorkMap[int, Transfer] = WorkMap()  # start order
        self._jobs_by_age: WorkMap[int, PinnedJob] = WorkMap()  # insertion order == age order
        # Every job not reported yet, wherever its supplies are: what close() must fail,
        # even if an exception left a supply between two homes.
        self._unreported: WorkMap[int, PinnedJob] = WorkMap()
        self._jobs_open = 0
        self._draining: WorkSet[tuple[str, int]] = WorkSet()
        self._results: list[StoreFinished] = []
        self._fetched: list[tuple[str, bool]] = []  # (id, the fetch's prefill_done)
        self._blocks_written = 0
        self._resolves_held = 0  # resolve fetches matched from held blocks (invariant 9)
        self._rounds_ok = 0
        self._rounds_failed = 0

    def set_consumer_region(self, num_blocks: int) -> None:
        """The peer's advertised slot count; every fetch index is checked against it."""
        self._consumer_blocks = num_blocks

    # -- wire ----------------------------------------------------------------

    def on_lookup(self, message: Lookup, now: float) -> None:
        key_bytes = sum(len(key) for key in message.keys)
        if key_bytes > self._settings.max_peer_bytes // ANSWER_SHARE:
            raise BudgetExceeded(
                f"a lookup for {message.kv_request_id!r} with {key_bytes} bytes of keys: "
                f"its answer may take at most max_peer_bytes/{ANSWER_SHARE} "
                f"({self._settings.max_peer_bytes // ANSWER_SHARE})"
            )
        request = self._request(message.kv_request_id)
        if message.round_seq <= request.closed_through:
            self._budget.check(keys_cost(message.keys) + LOOKUP_BYTES, message.kv_request_id,
                               "a lookup")  # fmt: skip
            self._prune(message.kv_request_id)
            return  # the consumer already closed that round
        if self._answer_held(message.kv_request_id, message.round_seq, message.keys, now):
            self._prune(message.kv_request_id)
            return
        self._lookups.queue(message.kv_request_id, request, message.round_seq, message.keys, now)

    def on_fetch(self, message: Fetch, now: float) -> None:
        kv_request_id = message.kv_request_id
        limit = self._consumer_blocks
        if limit is not None:
            for index in message.block_indexes:
                if index >= limit:
                    raise ProtocolError(
                        f"fetch {kv_request_id!r} round {message.round_seq}: block index "
                        f"{index} outside the peer's {limit} blocks"
                    )
        if len(set(message.keys)) != len(message.keys):
            raise ProtocolError(f"fetch {kv_request_id!r}: duplicate keys")
        request = self._request(kv_request_id)
        round_ = request.rounds.get(message.round_seq)
        if round_ is not None and (round_.demand is not None or round_.reply is not None):
            raise ProtocolError(f"second fetch for {kv_request_id!r} round {message.round_seq}")
        self._lookups.close_through(kv_request_id, request, message.round_seq)
        if message.is_terminal:
            # The consumer is done: release lookup pins nobody demanded.
            for seq, open_round in list(request.rounds.items()):
                if open_round.demand is None and open_round.reply is None:
                    self._release_supply(open_round.supply, True, "")
                    self._budget.held -= open_round.charge
                    del request.rounds[seq]
            self._prune(kv_request_id)
            return
        charge = keys_cost(message.keys) + ROUND_BYTES
        self._budget.check(charge, kv_request_id, "a fetch")
        if round_ is None:
            round_ = request.rounds[message.round_seq] = Round(message.round_seq)
        round_.charge += charge
        self._budget.held += charge
        round_.demand = dict(zip(message.keys, message.block_indexes, strict=True))
        round_.demanded = len(message.keys)
        held = message.resolve and self._pin_held(kv_request_id, message.round_seq,
                                                  message.keys, now)  # fmt: skip
        if held:
            self._resolves_held += 1
        if message.resolve and not held:  # held keys need no lookup (invariant 9)
            round_.looked_up = round_.resolving = True
            self._lookups.queue(
                kv_request_id, request, message.round_seq, message.keys, now, implicit=True
            )
        if not round_.looked_up:
            self._fetched.append((kv_request_id, message.prefill_done))  # PD: owner binds
        self._match(kv_request_id, request, round_, now)
        self._check_unmet(kv_request_id, request, round_, now)
        self._collect_writes(now)

    def on_abort_fetch(self, message: AbortFetch, now: float) -> None:
        request = self._requests.get(message.kv_request_id)
        round_ = request.rounds.get(message.round_seq) if request is not None else None
        if round_ is None:
            # Nothing of that round can touch the consumer's memory.
            self._send(AbortAck(kv_request_id=message.kv_request_id, round_seq=message.round_seq))
            return
        if round_.reply is not None:
            if isinstance(round_.reply, TransferDone):
                round_.reply = AbortAck(
                    kv_request_id=message.kv_request_id, round_seq=message.round_seq
                )
            return  # already draining: a duplicate abort keeps its deadline
        self._fail_round(
            message.kv_request_id,
            round_,
            now,
            "aborted by the peer",
            AbortAck(kv_request_id=message.kv_request_id, round_seq=message.round_seq),
        )

    def _answer_held(
        self, kv_request_id: str, round_seq: int, keys: tuple[Key, ...], now: float
    ) -> bool:
        """Answer a lookup from held blocks at once (invariant 9); False: not held."""
        if not self._pin_held(kv_request_id, round_seq, keys, now):
            return False
        self._lookups.answer_held(kv_request_id, round_seq, keys)
        return True

    def _pin_held(
        self, kv_request_id: str, round_seq: int, keys: tuple[Key, ...], now: float
    ) -> bool:
        """Pin ``keys`` from held blocks as the round's supply; False if not all held."""
        if self._held_supply is None or not keys:
            return False
        charge = keys_cost(keys) + ROUND_BYTES  # the round holds these pins (invariant 8)
        self._budget.check(charge, kv_request_id, "a lookup")
        slots = self._held_supply.pin(self._peer_id, keys)
        if slots is None:
            return False
        request = self._request(kv_request_id)
        round_ = request.rounds.setdefault(round_seq, Round(round_seq))
        round_.charge += charge
        self._budget.held += charge
        self._held_jobs -= 1
        job = StoreJob(self._held_jobs, keys, tuple(slots))
        self.add_supply(kv_request_id, job, now, round_seq, held=True)
        return True

    def _pin_held_prefix(
        self, kv_request_id: str, round_seq: int, keys: tuple[Key, ...], now: float
    ) -> int:
        """Pin the longest prefix of ``keys`` held blocks hold as the round's supply
        (invariant 10); how many keys. None, rather than over the peer's budget."""
        if self._held_supply is None:
            return 0
        count = self._held_supply.held_prefix(self._peer_id, keys)
        if count == 0:
            return 0
        try:
            pinned = self._pin_held(kv_request_id, round_seq, keys[:count], now)
        except BudgetExceeded:
            return 0  # checked before anything was pinned: the keys are misses
        return count if pinned else 0

    # -- engine-facing ---------------------------------------------------------

    def serve(self, parent: Parent, now: float) -> None:
        """Resolve queued lookups against the parent (the only place it is called)."""
        self._lookups.serve(parent, now)

    def add_supply(
        self,
        kv_request_id: str,
        job: StoreJob,
        now: float,
        round_seq: int | None = None,
        *,
        held: bool = False,
    ) -> None:
        """Pinned blocks to serve: pool supply, or one round's lookup supply
        (``held``: pinned from held blocks, invariant 9)."""
        request = self._request(kv_request_id)
        tracked = PinnedJob(job.job_id, kv_request_id, now, len(job.keys), held=held)
        self._jobs_by_age[job.job_id] = tracked
        self._unreported[job.job_id] = tracked
        if not held:
            self._jobs_open += 1
        if round_seq is None:
            home = request.pool
        else:
            round_ = request.rounds.setdefault(round_seq, Round(round_seq))
            round_.looked_up = True
            home = round_.supply
        for key, slot in zip(job.keys, job.slots, strict=True):
            supply = Supply(key, slot, tracked)
            tracked.supplies.append(supply)
            if key in home:
                self._settle(supply, True, "")  # pinned twice: keep the first
            else:
                supply.home = home
                home[key] = supply
        if tracked.open == 0:
            self._report(tracked)
        for round_ in list(request.rounds.values()):
            if round_.demand:
                self._match(kv_request_id, request, round_, now)
        self._prune(kv_request_id)
        self._collect_writes(now)

    def finish_supply(self, kv_request_id: str, now: float) -> None:
        """Our request for the id finished: no more stores; unmet demand fails now."""
        request = self._requests.get(kv_request_id)
        if request is None:
            return
        request.supply_complete = True
        for round_ in list(request.rounds.values()):
            self._check_unmet(kv_request_id, request, round_, now)

    # -- time ----------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Collect finished writes, drain deadlines, store timeouts and lookups the
        engine is not waited for any longer (invariant 10)."""
        self._collect_writes(now, eager=False)
        self._lookups.answer_busy(now)
        for kv_request_id, seq in self._draining:
            round_ = self._requests[kv_request_id].rounds[seq]
            if now >= round_.drain_deadline:
                self._timeouts["abort_drain"] += 1
                self._data.cancel(list(round_.inflight), wait=False)
                for transfer_id in list(round_.inflight):
                    self._forget_transfer(round_, transfer_id, False, "abandoned after drain")
                self._finish_drain(kv_request_id, round_)
        self._expire_transfers(now)
        deadline = self._settings.store_timeout_s
        while (oldest := self._jobs_by_age.first()) is not None:
            job_id, job = oldest
            if now < job.bound_at + deadline:
                break
            del self._jobs_by_age[job_id]
            self._timeouts["store"] += 1
            for supply in job.supplies:
                if supply.state is SupplyState.AVAILABLE:
                    self._settle(supply, False, f"not fetched within {deadline:g}s")
            self._prune(job.kv_request_id)

    def _collect_writes(self, now: float, *, eager: bool = True) -> None:
        """Handle finished writes: from ``tick``, and right after a write started
        (``eager``: a small write may be done already, and its reply goes out now
        instead of at the end of the poll)."""
        if eager and not self._transfers:
            return
        for event in self._data.poll(self._peer_id):
            self._on_transfer_event(event.transfer_id, event.success, event.reason, now)

    def _expire_transfers(self, now: float) -> None:
        """Writes still running past ``transfer_timeout_s`` fail their round: the
        consumer has given up on them, and their pins must not live forever."""
        limit = self._settings.transfer_timeout_s
        for transfer_id in self._transfers:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                continue  # settled by an earlier round failure in this loop
            if now < transfer.started_at + limit:
                return  # start order: every later one is younger
            round_ = self._requests[transfer.kv_request_id].rounds[transfer.round_seq]
            if round_.reply is None:
                self._timeouts["transfer"] += 1
                self._fail_round(
                    transfer.kv_request_id,
                    round_,
                    now,
                    f"writes did not finish within {limit:g}s",
                )

    def next_deadline(self) -> float | None:
        deadlines: list[float] = []
        first = self._transfers.first()
        if first is not None:
            deadlines.append(first[1].started_at + self._settings.transfer_timeout_s)
        oldest = self._jobs_by_age.first()
        if oldest is not None:
            deadlines.append(oldest[1].bound_at + self._settings.store_timeout_s)
        for kv_request_id, seq in self._draining:
            deadlines.append(self._requests[kv_request_id].rounds[seq].drain_deadline)
        lookups = self._lookups.next_deadline()
        if lookups is not None:
            deadlines.append(lookups)
        return min(deadlines, default=None)

    def take_results(self) -> tuple[list[StoreFinished], list[tuple[str, bool]]]:
        results, fetched = self._results, self._fetched
        self._results, self._fetched = [], []
        return results, fetched

    def close(self, reason: str) -> tuple[list[StoreFinished], list[ServeRequest]]:
        """Abandon everything: fail every open job, hand back owed serves."""
        if self._transfers:
            self._data.cancel(list(self._transfers), wait=False)
        for job in list(self._unreported.values()):
            for supply in job.supplies:
                if supply.state is not SupplyState.SETTLED:
                    self._settle(supply, False, reason)
        serves = self._lookups.close()
        results = self._results
        self._requests.clear()
        self._transfers.clear()
        self._jobs_by_age.clear()
        self._unreported.clear()
        self._draining.clear()
        self._results = []
        self._fetched = []
        self._budget.held = 0
        return results, serves

    def held_bytes(self) -> int:
        """What the peer makes us hold, as charged against its budget (invariant 8)."""
        return self._budget.bytes()

    # -- introspection ---------------------------------------------------------

    def needs_serve(self) -> bool:
        return self._lookups.needs_serve()

    def has_transfers(self) -> bool:
        return bool(self._transfers or self._draining)

    def is_empty(self) -> bool:
        """Nothing held for the peer: no request, transfer, job or owed serve."""
        return not (
            self._requests
            or self._transfers
            or self._draining
            or self._unreported
            or self._lookups.needs_serve()
        )

    def statistics(self) -> ProducerStatistics:
        pinned = 0
        rounds = 0
        for request in self._requests.values():
            pinned += len(request.pool)
            rounds += len(request.rounds)
            pinned += sum(len(r.supply) for r in request.rounds.values())
        return ProducerStatistics(
            requests=len(self._requests),
            rounds=rounds,
            transfers_in_flight=len(self._transfers),
            rounds_draining=len(self._draining),
            pinned_blocks=pinned,
            store_jobs_open=self._jobs_open,
            lookups_queued=self._lookups.queued_keys,
            lookups_answered=self._lookups.answered,
            lookups_held=self._lookups.held_answers,
            blocks_written=self._blocks_written,
            rounds_succeeded=self._rounds_ok,
            rounds_failed=self._rounds_failed,
            timeouts=dict(self._timeouts),
            lookups_from_held=self._lookups.held_answers + self._resolves_held,
            lookups_to_engine=self._lookups.to_engine,
        )

    # -- matching and transfers ------------------------------------------------

    def _match(
        self, kv_request_id: str, request: ProducerRequest, round_: Round, now: float
    ) -> None:
        demand = round_.demand
        if not demand or round_.reply is not None:
            return
        pairs: list[tuple[Supply, int]] = []
        for key, index in list(demand.items()):
            supply = round_.supply.pop(key, None) or request.pool.pop(key, None)
            if supply is not None:
                del demand[key]
                pairs.append((supply, index))
        if not pairs:
            return
        for supply, _ in pairs:
            supply.state = SupplyState.IN_FLIGHT
            supply.home = None
        supplies = [s for s, _ in pairs]
        try:
            transfer_id = self._data.write_blocks(
                self._peer_id, [s.slot for s in supplies], [i for _, i in pairs]
            )
        except DataPlaneError as exc:
            for supply in supplies:
                self._settle(supply, False, f"write failed to start: {exc}")
            self._fail_round(kv_request_id, round_, now, f"write failed to start: {exc}")
            return
        self._transfers[transfer_id] = Transfer(kv_request_id, round_.seq, supplies, now)
        round_.inflight.add(transfer_id)

    def _check_unmet(
        self, kv_request_id: str, request: ProducerRequest, round_: Round, now: float
    ) -> None:
        if not round_.demand or round_.reply is not None or round_.resolving:
            return
        if round_.looked_up:
            self._fail_round(
                kv_request_id, round_, now, f"{len(round_.demand)} keys were not pinned"
            )
        elif request.supply_complete:
            self._fail_round(kv_request_id, round_, now, f"no supply for {len(round_.demand)} keys")

    def _on_transfer_event(self, transfer_id: int, success: bool, reason: str, now: float) -> None:
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            return  # cancelled and abandoned earlier
        round_ = self._requests[transfer.kv_request_id].rounds[transfer.round_seq]
        self._forget_transfer(round_, transfer_id, success, reason or "write failed")
        if round_.reply is not None:
            if not round_.inflight:
                self._finish_drain(transfer.kv_request_id, round_)
        elif not success:
            self._fail_round(
                transfer.kv_request_id, round_, now, f"write failed: {reason or 'unknown'}"
            )
        elif not round_.demand and not round_.inflight:
            self._succeed_round(transfer.kv_request_id, round_)

    def _forget_transfer(self, round_: Round, transfer_id: int, success: bool, reason: str) -> None:
        transfer = self._transfers.pop(transfer_id)
        assert transfer is not None
        round_.inflight.discard(transfer_id)
        for supply in transfer.supplies:
            self._settle(supply, success, "" if success else reason)
        if success:
            round_.delivered += len(transfer.supplies)
            self._blocks_written += len(transfer.supplies)

    def _succeed_round(self, kv_request_id: str, round_: Round) -> None:
        self._release_supply(round_.supply, True, "")
        self._send(
            TransferDone(
                kv_request_id=kv_request_id,
                success=True,
                round_seq=round_.seq,
                blocks=round_.delivered,
            )
        )
        self._rounds_ok += 1
        self._drop_round(kv_request_id, round_)

    def _fail_round(
        self,
        kv_request_id: str,
        round_: Round,
        now: float,
        reason: str,
        reply: Message | None = None,
    ) -> None:
        """End a round unsuccessfully; reply once no write of it can land any more."""
        round_.resolving = False  # its own lookup ends at the next serve pass
        self._release_supply(round_.supply, False, reason)
        round_.demand = {}
        round_.reply = reply or TransferDone(
            kv_request_id=kv_request_id,
            success=False,
            round_seq=round_.seq,
            blocks=round_.delivered,
            reason=reason,
        )
        if round_.inflight:
            still = set(self._data.cancel(list(round_.inflight), wait=True))
            for transfer_id in list(round_.inflight):
                if transfer_id not in still:
                    self._forget_transfer(round_, transfer_id, False, reason)
        if round_.inflight:
            round_.drain_deadline = now + self._settings.abort_drain_timeout_s
            self._draining.add((kv_request_id, round_.seq))
        else:
            self._finish_drain(kv_request_id, round_)

    def _finish_drain(self, kv_request_id: str, round_: Round) -> None:
        self._draining.discard((kv_request_id, round_.seq))
        assert round_.reply is not None
        self._send(round_.reply)
        self._rounds_failed += 1
        self._drop_round(kv_request_id, round_)

    def _drop_round(self, kv_request_id: str, round_: Round) -> None:
        request = self._requests[kv_request_id]
        del request.rounds[round_.seq]
        self._budget.held -= round_.charge
        self._prune(kv_request_id)

    # -- jobs ------------------------------------------------------------------

    def _release_supply(self, supplies: dict[Key, Supply], success: bool, reason: str) -> None:
        for supply in list(supplies.values()):
            self._settle(supply, success, reason)

    def _settle(self, supply: Supply, success: bool, reason: str) -> None:
        if supply.state is SupplyState.SETTLED:
            return
        if supply.home is not None:
            supply.home.pop(supply.key, None)
            supply.home = None
        supply.state = SupplyState.SETTLED
        job = supply.job
        job.open -= 1
        if not success and not job.failed:
            job.failed = True
            job.reason = reason
        if job.open == 0:
            self._report(job)

    def _report(self, job: PinnedJob) -> None:
        if job.reported:
            return
        job.reported = True
        self._jobs_by_age.pop(job.job_id, None)
        self._unreported.pop(job.job_id, None)
        if job.held:
            assert self._held_supply is not None
            self._held_supply.unpin([supply.slot for supply in job.supplies])
            return
        self._jobs_open -= 1
        self._results.append(StoreFinished(job.job_id, not job.failed, job.reason))

    def _request(self, kv_request_id: str) -> ProducerRequest:
        """The id's entry, made on first use (not built to be thrown away when it exists)."""
        request = self._requests.get(kv_request_id)
        if request is None:
            request = self._requests[kv_request_id] = ProducerRequest()
        return request

    def _prune(self, kv_request_id: str) -> None:
        request = self._requests.get(kv_request_id)
        if request is not None and request.is_idle():
            del self._requests[kv_request_id]
            self._lookups.pending.discard(kv_request_id)

