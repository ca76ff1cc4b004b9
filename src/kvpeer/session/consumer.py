"""Consumer role: our requests pulling blocks from one peer. Sans-IO.

Invariants (per ``kv_request_id``):

1. A probe is registered once per round; until the round closes (our fetch
   for it, or finish) repeated lookups return the cached answer. A key the
   peer answered MISS stays MISS until the request finishes: later rounds
   do not ask for it again (the peer did not hold it when asked, and waiting
   for a second answer costs a producer serve window).
2. Probes registered since the last flush go out as one ``lookup`` per
   request per flush, tagged with the current round.
3. An answer resolves a probe only if it is still unresolved, and only for
   the current round when the peer tags its answers with one.
4. When a request's oldest probe has been unanswered for ``lookup_timeout_s``
   all its waiting probes become MISS and the id is reported once in
   ``expired_probe_ids`` (the tier then serves the request locally); nothing
   stays RETRY forever.
5. Each fetch opens round ``r`` and moves the counter to ``r + 1``; several
   rounds may be in flight and complete in any order.
6. Every load job is reported exactly once: at ``transfer_done``, at
   ``abort_ack``, when the ack times out, or at close. A load is never
   reported while the peer may still write into its slots, so an aborted
   load waits for the ack (or the ack timeout).
7. The terminal empty fetch is sent on finish exactly when a lookup went out
   after the last fetch (the peer holds lookup state no fetch closed).
8. A request's entry (and its round counter) lives until :meth:`finish`, and
   after that while an ``abort_ack`` is still owed (up to ``abort_ack_timeout_s``
   after the load settled): a round number is never reused while a late reply
   for it can arrive, so such a reply can never complete a newer load.
9. A load our peer would have to reject (slot outside our region, duplicate
   key, length mismatch, empty) raises ProtocolError and sends nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpeer.errors import ProtocolError
from kvpeer.protocol import (
    AbortAck,
    AbortFetch,
    Fetch,
    Lookup,
    LookupResponse,
    Message,
    TransferDone,
)
from kvpeer.session.ports import DataPlane
from kvpeer.session.results import LoadFinished
from kvpeer.session.settings import SessionSettings
from kvpeer.session.worklist import WorkSet
from kvpeer.types import Key

__all__ = ["ConsumerRole", "ConsumerStatistics"]


@dataclass(slots=True)
class _Load:
    job_id: int
    slots: tuple[int, ...]
    submitted_at: float
    aborted_at: float | None = None
    abort_reason: str = ""
    #: the orchestrator's word: past this, computing is faster than waiting (give_up_s)
    give_up_at: float | None = None

    def deadline(self, load_timeout_s: float) -> float:
        """When the load is aborted unless its transfer_done came first."""
        due = self.submitted_at + load_timeout_s
        return due if self.give_up_at is None else min(due, self.give_up_at)


@dataclass(slots=True)
class _Request:
    round_seq: int = 0  # the next round to open
    probes: dict[Key, bool | None] = field(default_factory=dict)
    missed: set[Key] = field(default_factory=set)  # answered MISS, in any round
    waiting_since: dict[Key, float] = field(default_factory=dict)  # unresolved probes
    unsent: list[Key] = field(default_factory=list)
    peer_lookup_open: bool = False
    loads: dict[int, _Load] = field(default_factory=dict)
    unacked: dict[int, float] = field(default_factory=dict)  # round -> stop waiting at
    finished: bool = False  # our request ended; until then the round counter must live

    def is_idle(self) -> bool:
        return self.finished and not (
            self.loads or self.probes or self.unsent or self.peer_lookup_open or self.unacked
        )


@dataclass(frozen=True, slots=True)
class ConsumerStatistics:
    requests: int
    loads_in_flight: int
    loads_aborting: int
    probes_waiting: int
    lookups_sent: int
    fetches_sent: int
    stale_answers: int
    #: since start, by kind: ``load``, ``abort_ack``, ``lookup``
    timeouts: dict[str, int] = field(default_factory=dict)


class ConsumerRole:
    """Pulls blocks for our requests from one peer."""

    def __init__(
        self,
        peer_id: str,
        send: Callable[[Message], None],
        data_plane: DataPlane,
        settings: SessionSettings,
        num_blocks: int,
    ) -> None:
        self._peer_id = peer_id
        self._num_blocks = num_blocks
        self._send = send
        self._data = data_plane
        self._settings = settings
        self._requests: dict[str, _Request] = {}
        # Work lists, so periodic work is proportional to active requests only.
        self._to_flush: WorkSet[str] = WorkSet()
        self._with_loads: WorkSet[str] = WorkSet()
        self._with_probes: WorkSet[str] = WorkSet()
        self._lingering: WorkSet[str] = WorkSet()  # entries kept only for owed abort_acks
        self._finished: list[LoadFinished] = []
        self._expired: list[str] = []
        self._lookups_sent = 0
        self._fetches_sent = 0
        self._stale_answers = 0
        self._timeouts: Counter[str] = Counter()
        self._lookup_waits: list[float] = []  # probe registered -> answered, per answer

    # -- engine-facing -------------------------------------------------------

    def register_probe(self, kv_request_id: str, key: Key, now: float) -> bool | None:
        """Probe ``key``: None while unanswered (RETRY), else the peer's answer."""
        request = self._request(kv_request_id)
        request.finished = False  # a reused id continues counting rounds
        if key in request.probes:
            return request.probes[key]
        if key in request.missed:
            return False
        request.probes[key] = None
        request.waiting_since[key] = now
        request.unsent.append(key)
        self._to_flush.add(kv_request_id)
        self._with_probes.add(kv_request_id)
        return None

    def flush(self) -> None:
        """Send one ``lookup`` per request with probes registered since last flush."""
        for kv_request_id in self._to_flush:
            request = self._requests.get(kv_request_id)
            if request is None or not request.unsent:
                continue
            self._send(
                Lookup(
                    kv_request_id=kv_request_id,
                    keys=tuple(request.unsent),
                    round_seq=request.round_seq,
                )
            )
            self._lookups_sent += 1
            request.unsent.clear()
            request.peer_lookup_open = True
        self._to_flush.clear()

    def request_blocks(
        self,
        job_id: int,
        kv_request_id: str,
        keys: Sequence[Key],
        slots: Sequence[int],
        now: float,
        *,
        prefill_done: bool = False,
        resolve: bool = False,
        give_up_s: float | None = None,
    ) -> None:
        """Fetch ``keys`` into our ``slots`` as a new round; the job reports later.
        ``prefill_done``: tell the producer its prefill leg already answered.
        ``resolve``: keys we never probed, that the producer is to look up itself
        (sent as such only if some key was not confirmed by a probe). ``give_up_s``:
        abort the round if it has not landed by then (the router's estimate of when
        computing the blocks would have been faster), as ``load_timeout_s`` does."""
        if len(keys) != len(slots):
            raise ProtocolError(f"load job {job_id}: {len(keys)} keys but {len(slots)} slots")
        if not keys:
            raise ProtocolError(f"load job {job_id}: an empty load has nothing to fetch")
        if len(set(keys)) != len(keys):
            raise ProtocolError(f"load job {job_id}: the same key appears twice")
        for slot in slots:
            if not 0 <= slot < self._num_blocks:
                raise ProtocolError(
                    f"load job {job_id}: slot {slot} outside our {self._num_blocks} blocks"
                )
        request = self._request(kv_request_id)
        request.finished = False
        # The peer pinned only confirmed hits; asking for more can only fail. A resolve
        # fetch has the peer look up what it was not asked yet (or has not answered).
        acceptable = (True, None) if resolve else (True,)
        unconfirmed = [k for k in keys if request.probes.get(k, True) not in acceptable]
        if unconfirmed:
            self._finished.append(
                LoadFinished(
                    job_id,
                    kv_request_id,
                    False,
                    f"{len(unconfirmed)} of {len(keys)} keys were not confirmed by the peer",
                )
            )
            self._prune(kv_request_id)
            return
        confirmed = {k for k in keys if request.probes.get(k) is True}
        round_seq = request.round_seq
        request.round_seq += 1
        slot_tuple = tuple(slots)
        give_up = None if give_up_s is None else now + give_up_s
        request.loads[round_seq] = _Load(job_id, slot_tuple, now, give_up_at=give_up)
        self._with_loads.add(kv_request_id)
        # The fetch closes the round's lookup phase: the next round probes anew,
        # because the peer unpins what this fetch does not take.
        self._clear_probes(kv_request_id, request)
        request.peer_lookup_open = False
        self._data.expect_writes(self._peer_id, slot_tuple)
        self._send(
            Fetch(
                kv_request_id=kv_request_id,
                keys=tuple(keys),
                block_indexes=slot_tuple,
                round_seq=round_seq,
                prefill_done=prefill_done,
                resolve=resolve and any(k not in confirmed for k in keys),
            )
        )
        self._fetches_sent += 1

    def finish(self, kv_request_id: str, now: float) -> None:
        """Our request ended: abort its loads, release the peer's lookup state."""
        self._to_flush.discard(kv_request_id)
        request = self._requests.get(kv_request_id)
        if request is None:
            return
        for round_seq, load in request.loads.items():
            if load.aborted_at is None:
                self._abort(kv_request_id, round_seq, load, now, "request finished")
        if request.peer_lookup_open:
            self._send(
                Fetch(
                    kv_request_id=kv_request_id,
                    keys=(),
                    block_indexes=(),
                    round_seq=request.round_seq,
                )
            )
            request.round_seq += 1
            request.peer_lookup_open = False
        request.unsent.clear()
        self._clear_probes(kv_request_id, request)
        request.missed.clear()
        request.finished = True
        self._prune(kv_request_id)

    # -- wire ----------------------------------------------------------------

    def on_lookup_response(self, message: LookupResponse, now: float) -> None:
        request = self._requests.get(message.kv_request_id)
        # Answers for a round we already closed must not resolve the next round.
        if request is None or (
            message.round_seq is not None and message.round_seq != request.round_seq
        ):
            self._stale_answers += 1
            return
        oldest: float | None = None
        for key, hit in zip(message.keys, message.hits, strict=True):
            if key in request.probes and request.probes[key] is None:
                request.probes[key] = hit
                if not hit:
                    request.missed.add(key)
                since = request.waiting_since.pop(key)
                oldest = since if oldest is None else min(oldest, since)
        if oldest is not None:
            self._lookup_waits.append(now - oldest)
        if not request.waiting_since:
            self._with_probes.discard(message.kv_request_id)

    def on_transfer_done(self, message: TransferDone, now: float) -> None:
        reason = "" if message.success else (message.reason or "peer reported failure")
        self._complete(message.kv_request_id, message.round_seq, message.success, reason, now)

    def on_abort_ack(self, message: AbortAck, now: float) -> None:
        request = self._requests.get(message.kv_request_id)
        if request is None:
            self._stale_answers += 1
            return
        if request.unacked.pop(message.round_seq, None) is not None:
            self._stale_answers += 1  # the owed ack of a load already settled
            self._prune(message.kv_request_id)
            return
        load = request.loads.get(message.round_seq)
        reason = load.abort_reason if load is not None and load.abort_reason else "aborted"
        self._complete(message.kv_request_id, message.round_seq, False, reason, now)

    # -- time ----------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Fire load, abort-ack and lookup timeouts due at ``now``."""
        for kv_request_id in self._with_loads:
            request = self._requests[kv_request_id]
            for round_seq, load in list(request.loads.items()):
                if load.aborted_at is None:
                    if now >= load.submitted_at + self._settings.load_timeout_s:
                        self._timeouts["load"] += 1
                        self._abort(
                            kv_request_id,
                            round_seq,
                            load,
                            now,
                            f"no transfer_done within {self._settings.load_timeout_s:g}s",
                        )
                    elif load.give_up_at is not None and now >= load.give_up_at:
                        self._timeouts["give_up"] += 1
                        self._abort(
                            kv_request_id,
                            round_seq,
                            load,
                            now,
                            f"no transfer_done within {load.give_up_at - load.submitted_at:g}s "
                            "(give_up_s: computing is faster now)",
                        )
                elif now >= load.aborted_at + self._settings.abort_ack_timeout_s:
                    self._timeouts["abort_ack"] += 1
                    self._complete(
                        kv_request_id,
                        round_seq,
                        False,
                        f"{load.abort_reason}; no abort_ack within "
                        f"{self._settings.abort_ack_timeout_s:g}s",
                        now,
                    )
        for kv_request_id in self._lingering:
            request = self._requests[kv_request_id]
            for round_seq, until in list(request.unacked.items()):
                if now >= until:
                    del request.unacked[round_seq]
            if not request.unacked:
                self._lingering.discard(kv_request_id)
                self._prune(kv_request_id)
        for kv_request_id in self._with_probes:
            request = self._requests[kv_request_id]
            oldest = next(iter(request.waiting_since.values()))
            if now >= oldest + self._settings.lookup_timeout_s:
                self._timeouts["lookup"] += 1
                for key in request.waiting_since:
                    request.probes[key] = False
                request.waiting_since.clear()
                self._with_probes.discard(kv_request_id)
                self._expired.append(kv_request_id)

    def next_deadline(self) -> float | None:
        deadlines: list[float] = []
        for kv_request_id in self._with_loads:
            for load in self._requests[kv_request_id].loads.values():
                if load.aborted_at is None:
                    deadlines.append(load.deadline(self._settings.load_timeout_s))
                else:
                    deadlines.append(load.aborted_at + self._settings.abort_ack_timeout_s)
        for kv_request_id in self._with_probes:
            oldest = next(iter(self._requests[kv_request_id].waiting_since.values()))
            deadlines.append(oldest + self._settings.lookup_timeout_s)
        for kv_request_id in self._lingering:
            deadlines.extend(self._requests[kv_request_id].unacked.values())
        return min(deadlines, default=None)

    def take_results(self) -> tuple[list[LoadFinished], list[str]]:
        finished, expired = self._finished, self._expired
        self._finished, self._expired = [], []
        return finished, expired

    def take_lookup_seconds(self) -> list[float]:
        """How long each answered lookup waited (oldest probe it answered), since
        the last call."""
        waits, self._lookup_waits = self._lookup_waits, []
        return waits

    def close(self, reason: str) -> tuple[list[LoadFinished], list[str]]:
        """Fail every load; return them and the ids that can no longer resolve."""
        failed = self._finished
        failed_ids: list[str] = []
        for kv_request_id, request in self._requests.items():
            if request.loads or request.waiting_since:
                failed_ids.append(kv_request_id)
            for load in request.loads.values():
                self._data.revoke_writes(self._peer_id, load.slots)
                failed.append(LoadFinished(load.job_id, kv_request_id, False, reason))
        self._requests.clear()
        self._to_flush.clear()
        self._with_loads.clear()
        self._with_probes.clear()
        self._lingering.clear()
        self._finished = []
        self._expired = []
        return failed, failed_ids

    # -- introspection ---------------------------------------------------------

    def request_ids(self) -> list[str]:
        """Every id this role holds state for (probes, loads, rounds, owed acks)."""
        return list(self._requests)

    def has_loads(self) -> bool:
        return bool(self._with_loads)

    def has_lookup_work(self) -> bool:
        return bool(self._to_flush)

    def waits_on_peer(self) -> bool:
        """A load in flight, or a probe not answered yet: a request waits on the peer."""
        return bool(self._with_loads or self._with_probes or self._to_flush)

    def statistics(self) -> ConsumerStatistics:
        in_flight = aborting = 0
        for kv_request_id in self._with_loads:
            for load in self._requests[kv_request_id].loads.values():
                in_flight += 1
                aborting += load.aborted_at is not None
        return ConsumerStatistics(
            requests=len(self._requests),
            loads_in_flight=in_flight,
            loads_aborting=aborting,
            probes_waiting=sum(len(self._requests[i].waiting_since) for i in self._with_probes),
            lookups_sent=self._lookups_sent,
            fetches_sent=self._fetches_sent,
            stale_answers=self._stale_answers,
            timeouts=dict(self._timeouts),
        )

    # -- internals -------------------------------------------------------------

    def _request(self, kv_request_id: str) -> _Request:
        """The id's entry, made on first use (not built to be thrown away when it exists)."""
        request = self._requests.get(kv_request_id)
        if request is None:
            request = self._requests[kv_request_id] = _Request()
        return request

    def _abort(
        self, kv_request_id: str, round_seq: int, load: _Load, now: float, reason: str
    ) -> None:
        load.aborted_at = now
        load.abort_reason = reason
        self._send(AbortFetch(kv_request_id=kv_request_id, round_seq=round_seq))

    def _complete(
        self, kv_request_id: str, round_seq: int, success: bool, reason: str, now: float
    ) -> None:
        request = self._requests.get(kv_request_id)
        load = request.loads.pop(round_seq, None) if request is not None else None
        if request is None or load is None:
            self._stale_answers += 1  # raced with a timeout, or never ours
            return
        if load.aborted_at is not None:
            # An abort_ack may still come for this round: keep counting rounds past it.
            request.unacked[round_seq] = now + self._settings.abort_ack_timeout_s
            self._lingering.add(kv_request_id)
        self._data.revoke_writes(self._peer_id, load.slots)
        blocks, seconds = (len(load.slots), now - load.submitted_at) if success else (0, 0.0)
        self._finished.append(
            LoadFinished(load.job_id, kv_request_id, success, reason, blocks, seconds)
        )
        if not request.loads:
            self._with_loads.discard(kv_request_id)
        self._prune(kv_request_id)

    def _clear_probes(self, kv_request_id: str, request: _Request) -> None:
        request.probes.clear()
        request.waiting_since.clear()
        request.unsent.clear()
        self._with_probes.discard(kv_request_id)

    def _prune(self, kv_request_id: str) -> None:
        request = self._requests.get(kv_request_id)
        if request is not None and request.is_idle():
            del self._requests[kv_request_id]
            self._lingering.discard(kv_request_id)
