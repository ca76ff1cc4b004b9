"""One engine's KV event stream as a sans-IO state machine: frames in, events out.

vLLM's ``ZmqEventPublisher`` sends each batch as a PUB multipart ``[topic, seq, payload]``
(``seq``: 8 bytes big-endian, counting from 0 in each engine process) and keeps the last
``buffer_steps`` batches for replay: a DEALER sends ``[b"", start_seq]`` to its ROUTER
and receives ``[b"", topic, seq, payload]`` for every buffered ``seq >= start_seq``,
then ``[b"", b"", END, b""]`` with ``END`` = -1 as a signed 8-byte integer. It sends the
whole answer at once, and its ROUTER socket drops whatever exceeds ZMQ's send high-water
mark (1,000 messages; vLLM sets none): a long answer arrives with holes, or without its
tail and its end marker.

:class:`EventFeed` turns those frames into :data:`FeedItem` values the index applies.
Invariants:

1. What the index holds for an engine is always a subset of what the engine holds (up to
   event latency): whenever events may have been lost -- an unreplayable gap, a rejected
   batch, an engine restart -- the feed emits :class:`StreamReset` first, and the index
   forgets. This is what rules out stale affinity.
2. A lost stretch is replayed when the engine has a replay endpoint: live frames that
   arrive meanwhile are buffered (bounded) and applied after the replayed ones, in
   ``seq`` order, each exactly once. A replayed batch that follows on is applied as it
   arrives; one past a hole is held (bounded) until the hole is filled. An answer is
   over at its end marker or after ``replay_timeout_s`` without a frame (it may flow for
   longer). If it left a hole, stopped short of the live batches held, or lost its end
   marker, the feed asks again from the first missing ``seq`` -- at most
   ``replay_reasks`` times, and only after an answer that moved the feed on -- and a
   replay never outlasts ``replay_budget_s``. What is still missing then is a hole
   (invariant 1).
3. ``seq`` going back means a new engine process (vLLM restarts counting at 0): reset
   with ``restarted=True`` (block hashes are salted per process, so even the hash
   mapping is void), then learn the new process from its first batch (replaying from 0
   if frames before the first one seen were missed).
4. :class:`StreamSynced` is emitted once the feed follows the stream from a known point
   (never before a replay's end): from then on the engine counts as learned, until the
   next reset.
5. Whether a publisher is still the process the feed followed is *proven*, never
   guessed (:meth:`EventFeed.verify`): the feed remembers the ``seq`` and a digest of
   the last batch it applied (an :class:`Anchor`) and asks the replay endpoint for every
   batch from that ``seq`` on. vLLM replays the bytes it published (each batch carries
   its wall-clock ``ts``), so the same process answers with that very batch first:
   :attr:`Continuity.SAME`, and the rest of the answer is the gap, applied as any
   replay. Other bytes at that ``seq``, nothing from it on, ``seq`` going back, or a
   restart the feed saw since the anchor: :attr:`Continuity.NEW` (reset as in 3). No
   replay endpoint, no anchor, a replay already under way, a buffer that no longer
   reaches back to the anchor, no frame within ``replay_timeout_s``:
   :attr:`Continuity.UNKNOWN`.
6. Nothing here raises on what the network sent; bad frames are counted by reason. A
   replayed ``seq`` never asked for is dropped, one applied or held already is skipped,
   and any other is taken as the engine's word: a huge one is a hole over what lies
   before it, and honest batches below it then read as a new process (invariant 3).
   Time is an argument; :meth:`EventFeed.next_deadline` says when to call
   :meth:`EventFeed.poll`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from hashlib import blake2b
from typing import Final

from kvpeer.router.events import (
    MAX_PAYLOAD_BYTES,
    BatchRejected,
    decode_batch,
)
from kvpeer.router.kvevents import KVEvent

__all__ = [
    "REPLAY_END_SEQ",
    "Anchor",
    "Continuity",
    "EventFeed",
    "FeedLimits",
    "FeedOutput",
    "FeedStatistics",
    "StreamReset",
    "StreamSynced",
    "encode_replay_request",
]

REPLAY_END_SEQ: Final = (1 << 64) - 1  # vLLM's END_SEQ: -1 as signed 8 bytes
_MAX_SEQ: Final = (1 << 63) - 1
MAX_UNKNOWN_NAMES: Final = 16  # distinct unknown field names kept per feed (metric labels)
OTHER_UNKNOWN: Final = "(other)"  # where the names past those are counted


@dataclass(frozen=True, slots=True)
class StreamReset:
    """Forget what the engine holds (invariant 1).

    ``restarted``: a new engine process -- its block hashes mean something else now.
    ``reason``: ``"restart"``, ``"gap"`` or ``"rejected_batch"``.
    """

    reason: str
    restarted: bool


@dataclass(frozen=True, slots=True)
class StreamSynced:
    """The stream is followed from a known point on; the engine is learned."""


FeedItem = KVEvent | StreamReset | StreamSynced


class Continuity(StrEnum):
    """What :meth:`EventFeed.verify` found out about the publisher (invariant 5)."""

    SAME = "same"  # it replayed the anchor batch byte for byte: the same process
    NEW = "new"  # another process (or the feed saw one since the anchor)
    UNKNOWN = "unknown"  # nothing proves either


@dataclass(frozen=True, slots=True)
class Anchor:
    """The last batch the feed applied: its ``seq``, a digest of its bytes, and the
    feed's process epoch at the time (bumped by every restart reset)."""

    seq: int
    digest: bytes
    epoch: int


@dataclass(frozen=True, slots=True)
class FeedOutput:
    """What one call produced: items to apply in order, maybe a replay to request, and
    maybe the answer to a pending :meth:`EventFeed.verify`."""

    items: tuple[FeedItem, ...] = ()
    replay_from: int | None = None  # send encode_replay_request(replay_from) now
    continuity: Continuity | None = None


@dataclass(frozen=True, slots=True)
class FeedLimits:
    """Bounds on a replay (invariant 2); each is checked here, naming a bad value.

    ``replay_timeout_s`` is an idle timeout: an answer is over once this long passes
    without a frame from the replay endpoint, however long it has been flowing.
    ``replay_budget_s`` bounds a whole replay, every ask of it together, so an endpoint
    that trickles frames forever cannot keep the feed replaying (and holding live
    batches). ``replay_reasks``: how often one replay asks again from its first missing
    ``seq`` after an answer that left a gap -- vLLM's replay socket drops what exceeds
    ZMQ's send high-water mark -- each only after an answer that moved the feed on.
    """

    replay_timeout_s: float = 5.0
    replay_budget_s: float = 120.0
    replay_reasks: int = 16
    max_replay_frames: int = 20_000  # held past a hole; vLLM keeps buffer_steps=10_000
    max_buffered_frames: int = 4_096  # live frames held while a replay runs
    max_buffered_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in ("replay_timeout_s", "replay_budget_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 < value < math.inf
            ):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if self.replay_budget_s < self.replay_timeout_s:
            raise ValueError(
                f"replay_budget_s ({self.replay_budget_s!r}) must be at least "
                f"replay_timeout_s ({self.replay_timeout_s!r})"
            )
        for name, least in (
            ("replay_reasks", 0),
            ("max_replay_frames", 1),
            ("max_buffered_frames", 1),
            ("max_buffered_bytes", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer of at least {least}, not {value!r}")


@dataclass(frozen=True, slots=True)
class FeedStatistics:
    synced: bool
    next_seq: int | None
    replaying: bool
    frames: int
    batches_applied: int
    events_applied: int
    gaps: int
    restarts: int
    resets: int
    replays_requested: int
    replays_completed: int
    replays_incomplete: int
    replays_reasked: int  # asks again from a replay's first missing seq
    replays_over_budget: int  # replays abandoned at replay_budget_s
    verified: tuple[tuple[str, int], ...]  # verify() answers, by Continuity value
    dropped: tuple[tuple[str, int], ...]  # frames/batches dropped, by reason
    skipped: tuple[tuple[str, int], ...]  # events left out by the decoder, by reason
    unknown_fields: tuple[tuple[str, int], ...] = ()  # fields a newer vLLM added, by name


def encode_replay_request(start_seq: int) -> list[bytes]:
    """The DEALER message asking vLLM's replay ROUTER for every batch from ``start_seq``."""
    return [b"", start_seq.to_bytes(8, "big")]


def _digest(payload: bytes) -> bytes:
    return blake2b(payload, digest_size=16).digest()


@dataclass(slots=True)
class _Replay:
    """One replay: its first ask and the re-asks that fill the holes of its answers."""

    origin: int  # the seq first asked for: a live seq below it is a new process
    start: int  # the seq the current ask asked for
    asked: int | None  # the feed's next seq when the current ask went out (progress)
    deadline: float  # the current answer is over without a frame by then
    budget: float  # the whole replay is abandoned then
    probe: Anchor | None = None  # a verify() waiting for the anchor batch
    asks: int = 1
    answered: bool = False  # a frame of the current answer arrived
    held: dict[int, bytes] = field(default_factory=dict)  # replayed past a hole
    live: list[tuple[int, bytes]] = field(default_factory=list)
    nbytes: int = 0


class _Applied(list[FeedItem]):
    """A list that hands each item to ``sink`` at once and keeps none of them."""

    def __init__(self, sink: Callable[[FeedItem], None]) -> None:
        super().__init__()
        self._sink = sink

    def append(self, item: FeedItem) -> None:
        self._sink(item)

    def extend(self, items: Iterable[FeedItem]) -> None:
        for item in items:
            self._sink(item)


class EventFeed:
    """Sequencing of one engine's KV event stream (see the module docstring)."""

    def __init__(
        self,
        *,
        can_replay: bool,
        limits: FeedLimits | None = None,
        sink: Callable[[FeedItem], None] | None = None,
    ) -> None:
        """``sink``: items go to it as they are produced, in order, instead of into the
        returned :class:`FeedOutput` (whose ``items`` is then empty). A replay of a long
        history then costs one batch's events at a time, not all of them at once (a
        10,000-batch replay made the router's memory jump by tens of MiB)."""
        self._sink = sink
        self._can_replay = can_replay
        self._limits = limits or FeedLimits()
        self._next: int | None = None  # next seq expected; None: no position yet
        self._fresh = True  # nothing applied since the last reset: holes cannot mislead
        self._synced = False
        self._replay: _Replay | None = None
        self._last: tuple[int, bytes] | None = None  # seq and bytes of the last batch
        self._epoch = 0  # bumped by every restart reset
        self._verdict: Continuity | None = None  # a verify() answer to hand out
        self._counts: dict[str, int] = {}
        self._dropped: dict[str, int] = {}
        self._skipped: dict[str, int] = {}
        self._unknown_fields: dict[str, int] = {}  # tolerated, counted (events.py inv. 6)

    # --- inputs -----------------------------------------------------------------------

    def start(self, now: float) -> FeedOutput:
        """The subscription is in place (the I/O shell calls this once its SUB connection
        completed the handshake, not earlier: a batch published between the replay's
        answer and the subscription would be in neither). With a replay endpoint, learn
        the history: from 0, or from the next ``seq`` if live batches came first."""
        if not self._can_replay or self._replay is not None:
            return FeedOutput()
        return FeedOutput(replay_from=self._begin_replay(self._next or 0, now))

    def anchor(self) -> Anchor | None:
        """The last batch applied (None: none since the last restart), to :meth:`verify`
        the publisher against later (invariant 5)."""
        if self._last is None:
            return None
        seq, payload = self._last
        return Anchor(seq, _digest(payload), self._epoch)

    def verify(self, anchor: Anchor | None, now: float) -> FeedOutput:
        """Is the publisher still the process that published ``anchor``? (invariant 5)

        The answer is this output's ``continuity``, or a later output's: then this one
        asks for a replay from the anchor's ``seq``, whose first frame decides.
        """
        if anchor is not None and anchor.epoch != self._epoch:
            self._verdict = Continuity.NEW  # the feed saw a new process since
            return self._output([])
        if anchor is None or not self._can_replay or self._replay is not None:
            self._verdict = Continuity.UNKNOWN
            return self._output([])
        start = self._begin_replay(anchor.seq, now)
        assert self._replay is not None
        self._replay.probe = anchor
        return FeedOutput(replay_from=start)

    def on_live(self, parts: Sequence[bytes], now: float) -> FeedOutput:
        """One PUB message ``[topic, seq, payload]``."""
        self._bump("frames")
        frame = self._parse(parts, replay=False)
        if frame is None:
            return FeedOutput()
        seq, payload = frame
        items = self._items()
        replay_from = self._live(seq, payload, now, items)
        return self._output(items, replay_from)

    def on_replay(self, parts: Sequence[bytes], now: float) -> FeedOutput:
        """One DEALER message from the replay endpoint (a batch, or the end marker).

        A replayed batch that follows on from what the feed applied is applied at once;
        one past a hole is held until the hole is filled or the replay ends."""
        self._bump("frames")
        replay = self._replay
        if replay is None:
            self._drop("replay_unexpected")
            return FeedOutput()
        items = self._items()
        if now >= replay.budget:
            self._over_budget(items)
            return self._output(items)
        replay.deadline = now + self._limits.replay_timeout_s  # the answer still flows
        if (
            len(parts) == 4
            and not parts[0]
            and not parts[1]
            and bytes(parts[2]) == REPLAY_END_SEQ.to_bytes(8, "big")
        ):
            if replay.probe is not None:  # nothing from the anchor on: not that process
                self._new_process(items)
                return self._output(items)
            return self._output(items, self._answer_over(replay, now, ended=True, items=items))
        frame = self._parse(parts[1:] if len(parts) == 4 and not parts[0] else parts, True)
        if frame is None:
            return self._output(items)
        probe, replay.probe = replay.probe, None
        if probe is not None and self._probe(probe, frame, items):
            replay.answered = True
        else:
            self._replayed(replay, frame, items)
        return self._output(items)

    def poll(self, now: float) -> FeedOutput:
        """End a replay answer that went quiet for ``replay_timeout_s`` (asking again
        from its first missing ``seq``, or applying what arrived), or a replay past
        ``replay_budget_s``."""
        replay = self._replay
        if replay is None or now < min(replay.deadline, replay.budget):
            return FeedOutput()
        items = self._items()
        if now >= replay.budget:
            self._over_budget(items)
            return self._output(items)
        return self._output(items, self._answer_over(replay, now, ended=False, items=items))

    def next_deadline(self) -> float | None:
        replay = self._replay
        return None if replay is None else min(replay.deadline, replay.budget)

    def reset(self, *, restarted: bool) -> FeedOutput:
        """The edge learned out of band that the engine restarted (or wants a resync)."""
        items = self._items()
        if self._replay is not None and self._replay.probe is not None:
            self._verdict = Continuity.UNKNOWN
        self._replay = None
        self._reset("restart" if restarted else "gap", restarted, items)
        self._next = None
        return self._output(items)

    def statistics(self) -> FeedStatistics:
        c = self._counts.get
        return FeedStatistics(
            synced=self._synced,
            next_seq=self._next,
            replaying=self._replay is not None,
            frames=c("frames", 0),
            batches_applied=c("batches_applied", 0),
            events_applied=c("events_applied", 0),
            gaps=c("gaps", 0),
            restarts=c("restarts", 0),
            resets=c("resets", 0),
            replays_requested=c("replays_requested", 0),
            replays_completed=c("replays_completed", 0),
            replays_incomplete=c("replays_incomplete", 0),
            replays_reasked=c("replays_reasked", 0),
            replays_over_budget=c("replays_over_budget", 0),
            verified=tuple(
                (v.value, c(f"verified_{v.value}", 0))
                for v in Continuity
                if c(f"verified_{v.value}", 0)
            ),
            dropped=tuple(sorted(self._dropped.items())),
            skipped=tuple(sorted(self._skipped.items())),
            unknown_fields=tuple(sorted(self._unknown_fields.items())),
        )

    # --- sequencing -------------------------------------------------------------------

    def _live(self, seq: int, payload: bytes, now: float, items: list[FeedItem]) -> int | None:
        replay = self._replay
        if replay is not None:
            floor = replay.live[-1][0] + 1 if replay.live else replay.origin
            if seq < floor:  # seq went back while we waited: a new process (invariant 3)
                if replay.probe is not None:
                    self._verdict = Continuity.NEW
                self._replay = None
                return self._restart_then(seq, payload, now, items)
            if len(replay.live) >= self._limits.max_buffered_frames or not self._hold(
                replay, (seq, payload), live=True
            ):
                self._drop("live_over_limit")
                self._finish_replay(complete=False, items=items)
                return self._live(seq, payload, now, items)
            return None
        if self._next is None:
            if seq == 0 or not self._can_replay:
                self._apply(seq, payload, items)
                return None
            return self._begin_replay_with(0, seq, payload, now)
        if seq == self._next:
            self._apply(seq, payload, items)
            return None
        if seq > self._next:
            self._bump("gaps")
            if self._can_replay:
                return self._begin_replay_with(self._next, seq, payload, now)
            self._hole(items)
            self._apply(seq, payload, items)
            return None
        return self._restart_then(seq, payload, now, items)

    def _restart_then(
        self, seq: int, payload: bytes, now: float, items: list[FeedItem]
    ) -> int | None:
        self._new_process(items)
        return self._live(seq, payload, now, items)

    def _new_process(self, items: list[FeedItem]) -> None:
        """The publisher is another process (invariant 3); a pending verify() says so."""
        if self._replay is not None and self._replay.probe is not None:
            self._verdict = Continuity.NEW
        self._replay = None
        self._bump("restarts")
        self._reset("restart", True, items)
        self._next = None

    def _probe(self, anchor: Anchor, frame: tuple[int, bytes], items: list[FeedItem]) -> bool:
        """The first frame of a verify() replay decides; True if that frame is done with
        (the anchor batch itself, or another process's)."""
        seq, payload = frame
        if seq == anchor.seq and _digest(payload) == anchor.digest:
            self._verdict = Continuity.SAME  # the rest of the replay is the gap
            return True
        if seq == anchor.seq:  # other bytes at the same seq: another process
            self._verdict = Continuity.NEW
            self._new_process(items)
            return True
        # The buffer no longer reaches back to the anchor (or the publisher sent what it
        # was not asked for): nothing proven; the rest is an ordinary gap replay.
        self._verdict = Continuity.UNKNOWN
        return False

    def _begin_replay(self, start: int, now: float) -> int:
        self._bump("replays_requested")
        self._replay = _Replay(
            origin=start,
            start=start,
            asked=self._next,
            deadline=now + self._limits.replay_timeout_s,
            budget=now + self._limits.replay_budget_s,
        )
        return start

    def _begin_replay_with(self, start: int, seq: int, payload: bytes, now: float) -> int:
        start = self._begin_replay(start, now)
        assert self._replay is not None
        self._hold(self._replay, (seq, payload), live=True)
        return start

    def _hold(self, replay: _Replay, frame: tuple[int, bytes], live: bool = False) -> bool:
        if replay.nbytes + len(frame[1]) > self._limits.max_buffered_bytes:
            return False
        replay.nbytes += len(frame[1])
        if live:
            replay.live.append(frame)
        else:
            replay.held[frame[0]] = frame[1]
        return True

    def _replayed(self, replay: _Replay, frame: tuple[int, bytes], items: list[FeedItem]) -> None:
        """One replayed batch: applied if it follows on, else held past the hole."""
        first, replay.answered = not replay.answered, True
        seq, payload = frame
        if self._next is not None and seq < self._next:
            if seq < replay.start:
                self._drop("replay_stale")  # never asked for
            return  # else applied already (the anchor's successors, say)
        if seq in replay.held:
            return  # a re-ask's answer repeats what the last one delivered past its hole
        if self._next is None or seq == self._next:  # fresh: any start is a subset
            self._apply(seq, payload, items)
            self._apply_held(replay, items, through=seq)
            return
        if len(replay.held) >= self._limits.max_replay_frames or not self._hold(replay, frame):
            self._drop("replay_over_limit")
            self._finish_replay(complete=False, items=items)
            return
        if first:
            # An answer starts at the oldest batch the buffer keeps from the seq asked
            # for: what it skipped is gone from the buffer, never to be replayed.
            self._apply_held(replay, items, through=seq)

    def _apply_held(self, replay: _Replay, items: list[FeedItem], *, through: int) -> None:
        """Apply the held batches up to ``through`` (past holes that cannot be filled),
        then those that follow on from them."""
        for seq in sorted(s for s in replay.held if s <= through):
            self._step(seq, self._unhold(replay, seq), items)
        while self._next in replay.held:
            self._step(self._next, self._unhold(replay, self._next), items)

    @staticmethod
    def _unhold(replay: _Replay, seq: int) -> bytes:
        payload = replay.held.pop(seq)
        replay.nbytes -= len(payload)
        return payload

    def _step(self, seq: int, payload: bytes, items: list[FeedItem]) -> None:
        """Apply a batch at or past the next ``seq``; batches skipped are a hole."""
        if self._next is not None and seq > self._next:
            self._hole(items)
        self._apply(seq, payload, items)

    def _answer_over(
        self, replay: _Replay, now: float, *, ended: bool, items: list[FeedItem]
    ) -> int | None:
        """An answer ended (its end marker: ``ended``) or went quiet. Ask again from the
        first missing ``seq`` when the answer left a hole, stopped short of the live
        batches held, or lost its end marker -- if it moved the feed on, re-asks are
        left -- else finish; returns the ``seq`` to ask."""
        position = self._next
        missing = position is not None and (
            not ended
            or bool(replay.held)
            or (bool(replay.live) and replay.live[0][0] > position)
        )
        progressed = position is not None and (replay.asked is None or position > replay.asked)
        if missing and progressed and replay.asks <= self._limits.replay_reasks:
            assert position is not None
            self._bump("replays_reasked")
            replay.asks += 1
            replay.start = replay.asked = position
            replay.answered = False
            replay.deadline = now + self._limits.replay_timeout_s
            return position
        self._finish_replay(complete=ended and not missing, items=items)
        return None

    def _over_budget(self, items: list[FeedItem]) -> None:
        self._bump("replays_over_budget")
        self._finish_replay(complete=False, items=items)

    def _finish_replay(self, *, complete: bool, items: list[FeedItem]) -> None:
        replay = self._replay
        assert replay is not None
        self._replay = None
        if replay.probe is not None:  # timed out or over a limit before its first frame
            self._verdict = Continuity.UNKNOWN
        self._bump("replays_completed" if complete else "replays_incomplete")
        for seq, payload in [*sorted(replay.held.items()), *replay.live]:
            if self._next is None:
                self._apply(seq, payload, items)  # fresh: any starting point is a subset
            elif seq >= self._next:  # else applied already (replayed and buffered live)
                self._step(seq, payload, items)
        if complete and self._next is None:
            # The publisher holds nothing from `origin` on: the stream is known up to there.
            self._next = replay.origin
        if self._next is not None:
            self._mark_synced(items)

    def _hole(self, items: list[FeedItem]) -> None:
        """Events were lost and cannot be replayed: forget unless nothing is known."""
        if not self._fresh:
            self._reset("gap", False, items)

    def _apply(self, seq: int, payload: bytes, items: list[FeedItem]) -> None:
        self._next = seq + 1
        self._last = (seq, payload)  # the anchor of a later verify()
        decoded = decode_batch(payload)
        if isinstance(decoded, BatchRejected):
            self._drop(decoded.reason)
            # Its removals are lost with it: forget, and continue from the next batch.
            self._hole(items)
            self._mark_synced(items)
            return
        self._mark_synced(items)
        self._bump("batches_applied")
        for reason, count in decoded.skipped:
            self._skipped[reason] = self._skipped.get(reason, 0) + count
        for wire_name, count in decoded.unknown_fields:
            # The names are an engine's bytes: a bounded few are kept by name (they
            # become metric labels), the rest counted together.
            known = self._unknown_fields
            name = (wire_name if wire_name in known or len(known) < MAX_UNKNOWN_NAMES
                    else OTHER_UNKNOWN)
            known[name] = known.get(name, 0) + count
        if decoded.events:
            self._fresh = False
            self._bump("events_applied", len(decoded.events))
            items.extend(decoded.events)

    def _mark_synced(self, items: list[FeedItem]) -> None:
        """Synced once the stream is followed (invariant 4): during a replay, batches are
        applied as they arrive, but the engine counts as learned only at its end."""
        if not self._synced and self._replay is None:
            self._synced = True
            items.append(StreamSynced())

    def _reset(self, reason: str, restarted: bool, items: list[FeedItem]) -> None:
        self._bump("resets")
        self._fresh = True
        self._synced = False
        if restarted:
            self._epoch += 1
            self._last = None
        items.append(StreamReset(reason, restarted))

    def _output(self, items: list[FeedItem], replay_from: int | None = None) -> FeedOutput:
        """The call's output, with the verify() answer it produced, if any."""
        verdict, self._verdict = self._verdict, None
        if verdict is not None:
            self._bump(f"verified_{verdict.value}")
        return FeedOutput(tuple(items), replay_from, verdict)

    # --- frames -----------------------------------------------------------------------

    def _items(self) -> list[FeedItem]:
        return [] if self._sink is None else _Applied(self._sink)

    def _parse(self, parts: Sequence[bytes], replay: bool) -> tuple[int, bytes] | None:
        if len(parts) != 3:
            self._drop("bad_frame_count")
            return None
        _topic, seq_bytes, payload = parts
        if len(seq_bytes) != 8:
            self._drop("bad_seq")
            return None
        seq = int.from_bytes(seq_bytes, "big")
        if seq > _MAX_SEQ:
            self._drop("bad_seq")
            return None
        if len(payload) > MAX_PAYLOAD_BYTES:
            self._drop("payload_too_large")
            return None
        return seq, bytes(payload)

    def _bump(self, name: str, by: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + by

    def _drop(self, reason: str) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
