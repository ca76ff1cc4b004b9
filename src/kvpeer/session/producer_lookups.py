"""A producer's inbound lookups: queued until a serve window resolves them. Sans-IO.

What :class:`kvpeer.session.producer.ProducerRole` keeps of the lookups a peer
sent, and the serve-window pass that resolves them against the parent. The
rules are the role's invariants 1, 2 and 8 (and 4's resolve fetch, whose own
lookup its round's reply answers); pins go through the role (``pin``), as does
a round whose demand can no longer be met (``unmet``). With the node's
:class:`~kvpeer.session.ports.EngineSteps`, a lookup still queued at its
``answer_by`` is answered without a window (the role's invariant 10).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvpeer.errors import ProtocolError
from kvpeer.protocol import LookupResponse, Message
from kvpeer.session.ports import EngineSteps, Parent
from kvpeer.session.producer_state import (
    LOOKUP_BYTES,
    MAX_QUEUED_LOOKUP_KEYS,
    InboundLookup,
    PeerBudget,
    ProducerRequest,
    Round,
    keys_cost,
)
from kvpeer.session.settings import SessionSettings
from kvpeer.session.worklist import WorkSet
from kvpeer.types import Key, LookupResult, ServeRequest, StoreJob

__all__ = ["InboundLookups"]

#: The role's: bind a pinned job as one round's supply (``add_supply``).
Pin = Callable[[str, StoreJob, float, int], None]
#: The role's: fail a round whose demand cannot be met any more.
Unmet = Callable[[str, ProducerRequest, Round, float], None]
#: The role's: pin the longest held prefix of keys as one round's supply; how many.
PinHeld = Callable[[str, int, tuple[Key, ...], float], int]


class InboundLookups:
    """The peer's lookups we owe an answer, and the serve requests they opened."""

    def __init__(
        self,
        peer_id: str,
        send: Callable[[Message], None],
        settings: SessionSettings,
        requests: dict[str, ProducerRequest],
        budget: PeerBudget,
        timeouts: Counter[str],
        *,
        pin: Pin,
        unmet: Unmet,
        prune: Callable[[str], None],
        engine: EngineSteps | None = None,
        pin_held: PinHeld | None = None,
    ) -> None:
        self._peer_id = peer_id
        self._send = send
        self._settings = settings
        self._requests = requests
        self._budget = budget
        self._timeouts = timeouts
        self._pin = pin
        self._unmet = unmet
        self._prune = prune
        self._engine = engine
        self._pin_held = pin_held
        self._seq = 0
        #: Ids with lookups to resolve in the next serve window.
        self.pending: WorkSet[str] = WorkSet()
        #: Serve requests to finish at the next serve window (their lookups were closed).
        self._unreleased: list[ServeRequest] = []
        self.queued_keys = 0
        self.answered = 0
        self.held_answers = 0
        self.to_engine = 0  # since start: lookups queued here, a resolve fetch's included
        self.busy_answers = 0  # since start: of those, answered at answer_by, not in a window
        self.busy_held_keys = 0  # since start: keys those answered as hits from held blocks

    def needs_serve(self) -> bool:
        return bool(self.pending or self._unreleased)

    def queue(
        self,
        kv_request_id: str,
        request: ProducerRequest,
        round_seq: int,
        keys: tuple[Key, ...],
        now: float,
        *,
        implicit: bool = False,
    ) -> None:
        """Keep a lookup for the next serve window (``implicit``: a resolve fetch's)."""
        charge = keys_cost(keys) + LOOKUP_BYTES
        self._budget.check(charge, kv_request_id, "a lookup")
        self.queued_keys += len(keys)
        if self.queued_keys > MAX_QUEUED_LOOKUP_KEYS:
            raise ProtocolError(
                f"more than {MAX_QUEUED_LOOKUP_KEYS} lookup keys queued by one peer"
            )
        self._budget.held += charge
        self.to_engine += 1
        request.lookups.append(
            InboundLookup(
                round_seq, keys, now, pending=dict.fromkeys(keys), charge=charge,
                implicit=implicit,
            )
        )  # fmt: skip
        self.pending.add(kv_request_id)

    def answer_held(self, kv_request_id: str, round_seq: int, keys: tuple[Key, ...]) -> None:
        """A lookup whose keys were all pinned from held blocks: every key a hit, now."""
        self._send(
            LookupResponse(
                kv_request_id=kv_request_id,
                keys=keys,
                hits=(True,) * len(keys),
                round_seq=round_seq,
            )
        )
        self.answered += 1
        self.held_answers += 1

    def close_through(self, kv_request_id: str, request: ProducerRequest, through: int) -> None:
        """The consumer closed rounds <= ``through``: their lookups get no answer."""
        request.closed_through = max(request.closed_through, through)
        keep: list[InboundLookup] = []
        for lookup in request.lookups:
            if lookup.round_seq <= through and not lookup.implicit:  # that one is its fetch's
                self.queued_keys -= len(lookup.keys)
                self._budget.held -= lookup.charge
                if lookup.serve is not None:
                    self._unreleased.append(lookup.serve)
            else:
                keep.append(lookup)
        request.lookups = keep
        if not keep:
            self.pending.discard(kv_request_id)

    def serve(self, parent: Parent, now: float) -> None:
        """Resolve queued lookups against the parent (the only place it is called)."""
        unreleased, self._unreleased = self._unreleased, []
        for serve in unreleased:
            parent.on_request_finished(serve)
        for kv_request_id in self.pending:
            request = self._requests[kv_request_id]
            for lookup in list(request.lookups):
                if self._resolve(kv_request_id, request, lookup, parent, now):
                    request.lookups.remove(lookup)
            if not request.lookups:
                self.pending.discard(kv_request_id)
            self._prune(kv_request_id)

    def next_deadline(self) -> float | None:
        """When the oldest lookup of some id stops waiting for its keys, or the first
        one the engine is not waited for any longer is due (:meth:`answer_busy`)."""
        deadlines: list[float] = []
        for kv_request_id in self.pending:
            lookups = self._requests[kv_request_id].lookups
            if lookups:
                oldest = lookups[0].received_at
                deadlines.append(oldest + self._settings.lookup_pending_timeout_s)
                due = self._engine.answer_by(oldest) if self._engine is not None else None
                if due is not None:
                    deadlines.append(due)
        return min(deadlines, default=None)

    def answer_busy(self, now: float) -> None:
        """Answer, without the engine, every queued lookup whose ``answer_by`` passed:
        keys already pinned stay hits, and so does the longest run of the rest, up to
        its first miss, that held blocks hold now (pinned then: a prompt whose tail left
        the held copy is pulled in part); the others are misses (a resolve fetch's
        lookup fails its round instead, through ``unmet``). A serve request it opened is
        finished in the next window."""
        if self._engine is None:
            return
        for kv_request_id in list(self.pending):
            request = self._requests[kv_request_id]
            for lookup in list(request.lookups):
                due = self._engine.answer_by(lookup.received_at)
                if due is None or now < due:
                    continue
                request.lookups.remove(lookup)
                self.busy_answers += 1
                self._timeouts["engine_wait"] += 1
                if not lookup.implicit:
                    self._answer_held_prefix(kv_request_id, lookup, now)
                for key in lookup.pending:
                    lookup.answers[key] = False
                lookup.pending.clear()
                if not lookup.implicit:  # as a window's pass would (invariant 4)
                    request.rounds.setdefault(lookup.round_seq, Round(lookup.round_seq))
                    request.rounds[lookup.round_seq].looked_up = True
                self._finish(kv_request_id, request, lookup, now, None)
            if not request.lookups:
                self.pending.discard(kv_request_id)
            self._prune(kv_request_id)

    def _answer_held_prefix(self, kv_request_id: str, lookup: InboundLookup, now: float) -> None:
        """Pin, as the lookup's round supply, the held prefix of its keys still
        unanswered (those before its first miss), and answer them hits."""
        if self._pin_held is None:
            return
        run: dict[Key, None] = {}  # ordered set: a peer's keys may repeat
        for key in lookup.keys:
            if key in lookup.pending:
                run[key] = None
            elif not lookup.answers[key]:
                break  # the consumer pulls no key past a miss
        if not run:
            return
        pinned = self._pin_held(kv_request_id, lookup.round_seq, tuple(run), now)
        for key in list(run)[:pinned]:
            lookup.answers[key] = True
            del lookup.pending[key]
        self.busy_held_keys += pinned

    def close(self) -> list[ServeRequest]:
        """Forget every lookup (the session ends): the serve requests still owed."""
        serves = self._unreleased
        for request in self._requests.values():
            serves.extend(lu.serve for lu in request.lookups if lu.serve is not None)
        self.pending.clear()
        self._unreleased = []
        self.queued_keys = 0
        return serves

    def _resolve(
        self,
        kv_request_id: str,
        request: ProducerRequest,
        lookup: InboundLookup,
        parent: Parent,
        now: float,
    ) -> bool:
        """One serve pass over a lookup; True once it was answered."""
        if lookup.implicit:
            found = request.rounds.get(lookup.round_seq)
            if found is None or not found.resolving:
                self._end(lookup, parent)  # its round failed or was aborted meanwhile
                return True
        round_ = request.rounds.setdefault(lookup.round_seq, Round(lookup.round_seq))
        if lookup.serve is None:
            self._seq += 1
            lookup.serve = ServeRequest(
                f"kvpeer:{self._peer_id}:{kv_request_id}:lookup{self._seq}",
                kv_request_id,
                self._peer_id,
            )
            parent.on_new_request(lookup.serve)
        round_.looked_up = True
        expired = now >= lookup.received_at + self._settings.lookup_pending_timeout_s
        hits: list[Key] = []
        for key in list(lookup.pending):
            if key in round_.supply or (lookup.implicit and key not in (round_.demand or ())):
                answer: bool | None = True  # already pinned for this round, or matched
            else:
                result = parent.lookup(key, lookup.serve)
                if result is LookupResult.HIT:
                    hits.append(key)
                    continue
                answer = False if result is LookupResult.MISS or expired else None
                if expired and result is not LookupResult.MISS:
                    self._timeouts["lookup_pending"] += 1
            if answer is not None:
                lookup.answers[key] = answer
                del lookup.pending[key]
        if hits:
            job = parent.create_store_job(hits, lookup.serve)
            for key in job.keys:
                lookup.answers[key] = True
                lookup.pending.pop(key, None)
            self._pin(kv_request_id, job, now, lookup.round_seq)
            for key in hits:  # a parent that pinned fewer keys than asked: not hits
                if key in lookup.pending:
                    lookup.answers[key] = False
                    del lookup.pending[key]
        if lookup.pending:
            return False
        self._finish(kv_request_id, request, lookup, now, parent)
        return True

    def _finish(
        self,
        kv_request_id: str,
        request: ProducerRequest,
        lookup: InboundLookup,
        now: float,
        parent: Parent | None,
    ) -> None:
        """Every key of ``lookup`` is answered: send the answer (a resolve fetch's
        round is settled instead, invariant 4). ``parent``: None outside a window."""
        self._end(lookup, parent)
        if lookup.implicit:  # the round's reply answers it (invariant 4)
            round_ = request.rounds.get(lookup.round_seq)
            if round_ is not None and round_.resolving:
                round_.resolving = False
                self._unmet(kv_request_id, request, round_, now)
            return
        self._send(
            LookupResponse(
                kv_request_id=kv_request_id,
                keys=lookup.keys,
                hits=tuple(lookup.answers[k] for k in lookup.keys),
                round_seq=lookup.round_seq,
            )
        )
        self.answered += 1

    def _end(self, lookup: InboundLookup, parent: Parent | None) -> None:
        """Release what ``lookup`` held; its serve request (if it opened one) is
        finished now in a window (``parent``), else in the next one."""
        self.queued_keys -= len(lookup.keys)
        self._budget.held -= lookup.charge
        if lookup.serve is not None:
            if parent is None:
                self._unreleased.append(lookup.serve)
            else:
                parent.on_request_finished(lookup.serve)
