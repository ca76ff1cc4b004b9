"""One peer session: both roles over one control link, its ending and error policy. Sans-IO.

The session combines a consumer role and a producer role over one control
link. It never reads a clock or touches a socket: frames come in through
:meth:`PeerSession.receive` (or :meth:`PeerSession.deliver`, decoded), go
out through the injected ``transmit``, and every call that can expire
something takes ``now``. Its phase (:class:`~kvpeer.session.handshake.Phase`)
and what a peer's ``connect`` means are :mod:`kvpeer.session.handshake`'s;
whether a silent peer is still there is :mod:`kvpeer.session.liveness`'s.

Invariants:

1. Our ``connect`` is the first frame we send. Everything else waits in a
   bounded queue until the peer's ``connect_ack``; the queue overflowing, or
   ``transmit`` refusing a frame, ends the session: ``OVER_BUDGET`` when the
   injected ``unread`` says the link gave up because the peer does not read
   what we send (a budget the peer broke, named so in the log and the
   metrics), ``UNREACHABLE`` otherwise.
2. The peer's ``connect`` is checked (block length, fingerprint, hash seed,
   the admit callback), its region is registered with the data plane, and
   only then is it acknowledged: our ack promises that we can write into the
   peer's memory safely.
3. A second ``connect`` is a protocol error, a restart (new ``boot_id``:
   ``RESTARTED``), the same grant asked again (acknowledged again), or the
   peer's next session (a higher session number): ``RENEWED`` without a
   goodbye once the peer acknowledged us or our producer role holds anything
   (only the ids this session held consumer state for fail), else adopted.
   The rules in full are :mod:`kvpeer.session.handshake`'s invariant 3.
4. The handshake (both connects, both acks) must finish within
   ``handshake_timeout_s`` of :meth:`start`. A request does not wait that long
   on a peer that never answered, nor on one that went quiet later: while a
   load or probe waits, the peer's silence ends the session as
   ``UNREACHABLE`` after ``peer_wait_s`` (:mod:`kvpeer.session.liveness`: one
   ``ping`` first to a peer that answers pings; a peer never heard from gets
   no ``disconnect`` and its queued frames are dropped unsent, one that was
   heard gets one for when it resumes).
5. One exception boundary (:meth:`PeerSession._guard`) wraps every entry
   point that runs on what the peer sent (``receive``, ``poll``, ``serve`` and
   every consumer/producer call): nothing raised below it leaves the session.
   What was raised names how the session ends: a protocol error
   (``PROTOCOL_ERROR``), a failed handshake check (``REJECTED``), a data-plane
   error the peer's values caused (``PEER_FAULT``), a fault of our own data
   plane (``LOCAL_FAULT``), the peer's budget exceeded (``OVER_BUDGET``) or
   any other exception - a bug of ours the peer's input reached
   (``INTERNAL_ERROR``, kept in :attr:`SessionClosed.error` for the log).
   Each ends only this session: best-effort ``disconnect`` with the reason,
   then every job the session held fails. The ending is reported exactly
   once, as :attr:`PollResult.closed` of the next poll. Misuse by the owner
   (``receive`` before ``start``) still raises: that is not the peer's doing.
6. Unknown message types are counted and ignored.
7. A frame that cannot belong to this session (a straggler of an ended one:
   :mod:`kvpeer.session.handshake` invariant 7) is dropped and counted
   (:attr:`SessionStatistics.stale_frames`), never a protocol error, and not
   heard from the peer (invariant 4's clocks ignore it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from kvpeer.errors import (
    BudgetExceeded,
    DataPlaneError,
    HandshakeRejected,
    LocalFault,
    ProtocolError,
)
from kvpeer.protocol import (
    PING_VERSION,
    PROTOCOL_VERSION,
    RESOLVE_VERSION,
    AbortAck,
    AbortFetch,
    AckExtension,
    Codec,
    Connect,
    ConnectAck,
    Disconnect,
    Fetch,
    Inbound,
    Lookup,
    LookupResponse,
    Message,
    Ping,
    Pong,
    Prefetch,
    PrefetchRefused,
    TransferDone,
    TransportChoice,
    Undecodable,
    UnknownMessage,
    limits,
)
from kvpeer.session.consumer import ConsumerRole, ConsumerStatistics
from kvpeer.session.greeting import incompatibility
from kvpeer.session.handshake import Handshake, Phase, Verdict
from kvpeer.session.liveness import Liveness, Silence
from kvpeer.session.ports import DataPlane, EngineSteps, HeldSupply, Parent
from kvpeer.session.producer import ProducerRole, ProducerStatistics
from kvpeer.session.results import (
    CloseKind,
    LoadFinished,
    PollResult,
    SessionClosed,
)
from kvpeer.session.settings import SessionSettings
from kvpeer.types import Key, StoreJob

__all__ = ["Admit", "PeerSession", "SessionStatistics"]

#: Policy hook: return a rejection reason, or None to admit the peer.
Admit = Callable[[str, Connect], str | None]


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    peer_id: str
    ready: bool
    closed: bool
    frames_received: int
    frames_sent: int
    unknown_messages: int
    stale_frames: int  # invariant 7: dropped as stragglers of an ended session
    queued_messages: int
    pings_sent: int
    consumer: ConsumerStatistics
    producer: ProducerStatistics


_NOTHING = PollResult()


class PeerSession:
    """Both roles toward one peer over one control link."""

    def __init__(
        self,
        peer_id: str,
        hello: Connect,
        data_plane: DataPlane,
        transmit: Callable[[bytes], bool],
        settings: SessionSettings | None = None,
        *,
        admit: Admit | None = None,
        held: HeldSupply | None = None,
        engine: EngineSteps | None = None,
        unread: Callable[[], str | None] | None = None,
    ) -> None:
        """``held``: blocks the node keeps a copy of, served at once (producer
        invariant 9); ``engine``: when a lookup stops waiting for the engine (producer
        invariant 10)."""
        self.peer_id = peer_id
        self._hello = hello
        self._data = data_plane
        self._transmit = transmit
        self._unread = unread  # after a refused frame: why, if the peer does not read
        self._settings = settings or SessionSettings()
        self._admit = admit
        self._codec = Codec()
        self._consumer = ConsumerRole(
            peer_id, self._send, data_plane, self._settings, hello.num_blocks
        )
        self._producer = ProducerRole(peer_id, self._send, data_plane, self._settings, held,
                                      engine)  # fmt: skip
        self._handshake = Handshake(hello, self._settings.max_queued_messages)
        self._liveness = Liveness(self._settings.peer_wait_s)
        self._deferred_close: tuple[CloseKind, str] | None = None
        self._closed: SessionClosed | None = None
        self._close_reported = False
        self._late_loads: list[LoadFinished] = []
        self._frames_in = 0
        self._frames_out = 0
        self._unknown = 0
        self._guard_cm = _Guard(self)
        self._stragglers = 0

    # -- state -----------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._closed is None

    @property
    def phase(self) -> Phase:
        return self._handshake.phase

    @property
    def ready(self) -> bool:
        """Handshake complete in both directions."""
        return self._handshake.phase is Phase.READY

    @property
    def answered(self) -> bool:
        """The peer acknowledged our connect (at some point; stays True after close)."""
        return self._handshake.answered

    @property
    def peer_hello(self) -> Connect | None:
        """The peer's ``connect``, once received."""
        return self._handshake.peer_hello

    def adopts(self, hello: Connect) -> bool:
        """Invariant 3: ``hello`` opens the peer's next session and this one (not
        acknowledged, serving nothing) would take it in as a first ``connect``."""
        return self._handshake.adopts(hello) and self._producer.is_empty()

    @property
    def peer_boot_id(self) -> bytes | None:
        hello = self._handshake.peer_hello
        return hello.kvpeer.boot_id if hello is not None and hello.kvpeer is not None else None

    def has_work(self) -> bool:
        """Loads or writes in flight, peer work to serve, or results not yet polled."""
        if self._closed is not None:
            return not self._close_reported or bool(self._late_loads)
        return (
            self._consumer.has_loads()
            or self._consumer.has_lookup_work()
            or self._producer.has_transfers()
            or self._producer.needs_serve()
        )

    def has_transfers(self) -> bool:
        """Loads or writes in flight that may still touch either side's memory."""
        return self._closed is None and (
            self._consumer.has_loads() or self._producer.has_transfers()
        )

    def needs_serve(self) -> bool:
        return self._closed is None and self._producer.needs_serve()

    def next_deadline(self) -> float | None:
        if self._closed is not None:
            return None
        deadlines = [
            d
            for d in (self._consumer.next_deadline(), self._producer.next_deadline())
            if d is not None
        ]
        handshake = self._handshake.deadline(self._settings.handshake_timeout_s)
        if handshake is not None:
            deadlines.append(handshake)
        silence = self._silence()
        if silence is not None:
            deadlines.append(silence.give_up_at)
            if silence.ping_at is not None:
                deadlines.append(silence.ping_at)
        return min(deadlines, default=None)

    def statistics(self) -> SessionStatistics:
        return SessionStatistics(
            peer_id=self.peer_id,
            ready=self.ready,
            closed=self._closed is not None,
            frames_received=self._frames_in,
            frames_sent=self._frames_out,
            unknown_messages=self._unknown,
            stale_frames=self._stragglers,
            queued_messages=self._handshake.queued,
            pings_sent=self._liveness.pings,
            consumer=self._consumer.statistics(),
            producer=self._producer.statistics(),
        )

    # -- lifecycle -------------------------------------------------------------

    def start(self, now: float) -> None:
        """Send our ``connect``; the handshake deadline runs from here."""
        if self._handshake.started_at is not None:
            raise ProtocolError(f"session {self.peer_id} already started")
        self._handshake.start(now)
        self._transmit_now(self._hello)
        self._settle_deferred_close()

    def receive(self, frame: bytes | bytearray | memoryview, now: float) -> None:
        """Handle one control frame from the peer."""
        self.deliver(self._codec.read(frame), now)

    def deliver(self, message: Inbound, now: float) -> None:
        """Handle one control frame from the peer that its owner decoded
        (:meth:`Codec.read`): what :meth:`receive` does, without decoding again."""
        if self._handshake.started_at is None:
            raise ProtocolError(f"session {self.peer_id}: receive() before start()")
        if self._closed is not None:
            return
        self._frames_in += 1
        with self._guard():
            if isinstance(message, Undecodable):
                raise message.error
            if self._handshake.is_straggler(message):
                self._stragglers += 1  # invariant 7: not heard, not an error
                return
            self._liveness.heard_at(now)
            self._dispatch(message, now)

    def poll(self, now: float) -> PollResult:
        """Fire due timers and return everything that finished since last poll."""
        with self._guard():
            self._fire_timers(now)
        loads, expired = self._consumer.take_results()
        stores, fetched = self._producer.take_results()
        if self._late_loads:
            loads.extend(self._late_loads)
            self._late_loads = []
        closed = None
        if self._closed is not None and not self._close_reported:
            closed = self._closed
            self._close_reported = True
        lookup_seconds = self._consumer.take_lookup_seconds()
        if closed is None and not (loads or stores or fetched or expired or lookup_seconds):
            return _NOTHING  # most polls (frozen, so one instance serves them all)
        return PollResult(
            loads=tuple(loads),
            stores=tuple(stores),
            fetched_ids=tuple(kv_id for kv_id, _ in fetched),
            prefilled_ids=tuple(kv_id for kv_id, done in fetched if done),
            expired_probe_ids=tuple(expired),
            closed=closed,
            lookup_seconds=tuple(lookup_seconds),
        )

    def _fire_timers(self, now: float) -> None:
        if self._closed is None:
            silence = self._silence()
            handshake_due = self._handshake.deadline(self._settings.handshake_timeout_s)
            if silence is not None and now >= silence.give_up_at:
                heard = self._liveness.heard
                self._end(
                    CloseKind.UNREACHABLE,
                    (
                        "nothing heard from the peer (pinged) for peer_wait_s "
                        if heard
                        else "the peer did not answer within peer_wait_s "
                    )
                    + f"({self._settings.peer_wait_s:g}s) while a request waited",
                    send_disconnect=heard,
                )
            elif handshake_due is not None and now >= handshake_due:
                self._end(
                    CloseKind.TIMEOUT,
                    f"handshake not complete within {self._settings.handshake_timeout_s:g}s",
                    send_disconnect=True,
                )
            else:
                if silence is not None and silence.ping_at is not None and now >= silence.ping_at:
                    self._liveness.pinged()
                    self._transmit_now(Ping())
                self._consumer.tick(now)
                self._producer.tick(now)

    def _silence(self) -> Silence | None:
        """Invariant 4, while a request waits: when to give the peer up, and when
        to ping it first."""
        started_at = self._handshake.started_at
        if started_at is None or not self._consumer.waits_on_peer():
            return None
        answers_pings = self._peer_at_least(PING_VERSION)
        return self._liveness.silence(started_at, answers_pings, self._handshake.answered)

    def _peer_at_least(self, version: tuple[int, int]) -> bool:
        hello = self._handshake.peer_hello
        ext = hello.kvpeer if hello is not None else None
        return ext is not None and tuple(ext.version) >= version

    @property
    def resolves_fetches(self) -> bool:
        """Ready, and the peer serves ``Fetch.resolve`` (kvpeer >= 1.2)."""
        return self.ready and self._peer_at_least(RESOLVE_VERSION)

    def close(self, reason: str = "closed locally", kind: CloseKind = CloseKind.LOCAL) -> None:
        """End the session; the failed jobs arrive with the next :meth:`poll`."""
        self._end(kind, reason, send_disconnect=True)

    # -- consumer API ----------------------------------------------------------

    def register_probe(self, kv_request_id: str, key: Key, now: float) -> bool | None:
        """None while the peer has not answered; a dead session answers MISS."""
        if self._closed is not None:
            return False
        self._note_wait(now)
        with self._guard():
            return self._consumer.register_probe(kv_request_id, key, now)
        return False  # the session ended inside the guard

    def flush_lookups(self) -> None:
        """Send the probes registered since the last flush (every engine step: most
        steps have none, and skip the guard)."""
        if self._closed is None and self._consumer.has_lookup_work():
            with self._guard():
                self._consumer.flush()

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
        """The consumer's next round (ConsumerRole.request_blocks has the flags)."""
        if self._closed is not None:
            self._late_loads.append(
                LoadFinished(job_id, kv_request_id, False, f"session closed: {self._closed.reason}")
            )
            return
        # Not guarded: a bad job is the engine's mistake (ProtocolError to the owner).
        self._note_wait(now)
        self._consumer.request_blocks(job_id, kv_request_id, keys, slots, now,
                                      prefill_done=prefill_done, resolve=resolve,
                                      give_up_s=give_up_s)  # fmt: skip
        self._settle_deferred_close()

    def _note_wait(self, now: float) -> None:
        """A load or probe is about to wait: if none waited, the quiet clock starts now."""
        if not self._consumer.waits_on_peer():
            self._liveness.wait_begins(now)

    def finish_consumer(self, kv_request_id: str, now: float) -> None:
        if self._closed is None:
            with self._guard():
                self._consumer.finish(kv_request_id, now)

    # -- producer API ----------------------------------------------------------

    def serve(self, parent: Parent, now: float) -> None:
        if self._closed is None:
            with self._guard():
                self._producer.serve(parent, now)

    def add_supply(self, kv_request_id: str, job: StoreJob, now: float) -> bool:
        """Bind stored blocks to this peer; False (job untouched) if the session is closed."""
        if self._closed is not None:
            return False
        with self._guard():
            self._producer.add_supply(kv_request_id, job, now)
        return True  # taken: a session that ended just now fails the job itself

    def finish_supply(self, kv_request_id: str, now: float) -> None:
        if self._closed is None:
            with self._guard():
                self._producer.finish_supply(kv_request_id, now)

    # -- the exception boundary (invariant 5) -------------------------------------

    def _guard(self) -> _Guard:
        """Run a step on the peer's input; whatever it raises ends this session."""
        return self._guard_cm

    def _ended_by(self, exc: Exception) -> None:
        """The exception boundary (invariant 5): ``exc`` names how the session ends."""
        if isinstance(exc, BudgetExceeded):  # a ProtocolError, named apart
            self._end(CloseKind.OVER_BUDGET, str(exc))
        elif isinstance(exc, ProtocolError):
            self._end(CloseKind.PROTOCOL_ERROR, str(exc))
        elif isinstance(exc, HandshakeRejected):
            self._end(CloseKind.REJECTED, str(exc))
        elif isinstance(exc, LocalFault):
            self._end(CloseKind.LOCAL_FAULT, f"our data plane failed: {exc}", error=exc)
        elif isinstance(exc, DataPlaneError):
            self._end(CloseKind.PEER_FAULT, f"data plane: {exc}")
        else:  # a bug of ours; the peer must not take the node down
            self._end(
                CloseKind.INTERNAL_ERROR,
                f"internal error: {exc.__class__.__name__}: {exc}",
                error=exc,
            )

    # -- dispatch --------------------------------------------------------------

    def _dispatch(self, message: Message | UnknownMessage, now: float) -> None:
        if isinstance(message, UnknownMessage | Prefetch | PrefetchRefused):
            self._unknown += 1  # router <-> node messages belong to no session
            return
        if isinstance(message, Connect):
            self._on_connect(message)
            return
        if isinstance(message, Disconnect):
            why = message.reason or "no reason given"
            self._end(CloseKind.DISCONNECTED, f"peer disconnected: {why}", send_disconnect=False)
            return
        if self._handshake.peer_hello is None:
            raise ProtocolError(f"{message.__class__.__name__} before the peer's connect")
        match message:
            case ConnectAck():
                self._on_connect_ack(message)
            case Lookup():
                self._producer.on_lookup(message, now)
            case LookupResponse():
                self._consumer.on_lookup_response(message, now)
            case Fetch():
                self._producer.on_fetch(message, now)
            case TransferDone():
                self._consumer.on_transfer_done(message, now)
            case AbortFetch():
                self._producer.on_abort_fetch(message, now)
            case AbortAck():
                self._consumer.on_abort_ack(message, now)
            case Ping():
                self._send(Pong())
            case Pong():
                pass  # being heard is all it is for (receive noted the time)

    def _on_connect(self, hello: Connect) -> None:
        handshake = self._handshake
        match handshake.verdict(hello, self._producer.is_empty()):
            case Verdict.RESTARTED:
                self._end(
                    CloseKind.RESTARTED, "peer restarted (new boot id)", send_disconnect=False
                )
                return
            case Verdict.RENEWED:
                self._end(
                    CloseKind.RENEWED,
                    "peer began a new session (same boot id; its side of this one ended)",
                    send_disconnect=False,
                )
                return
            case Verdict.REPEATED:
                assert handshake.ack is not None
                self._transmit_now(handshake.ack)  # idempotent; ending the session is not
                return
            case Verdict.DUPLICATE:
                raise ProtocolError("duplicate connect")
            case Verdict.ADOPTED:
                # Checked and registered afresh (the registration replaces the last;
                # the windows our queued fetches opened stay open).
                handshake.forget_peer()
                self._transmit_now(self._hello)  # the peer's new session never got ours
        handshake.peer_hello = hello
        reason = incompatibility(hello, self._hello) or (
            self._admit(self.peer_id, hello) if self._admit is not None else None
        )
        if reason is not None:
            raise HandshakeRejected(reason)
        try:
            choice = self._data.register_peer(self.peer_id, hello)
        except LocalFault:
            raise  # ours: the guard reports it as such
        except (DataPlaneError, HandshakeRejected) as exc:
            raise HandshakeRejected(f"data plane refused the peer: {exc}") from exc
        self._producer.set_consumer_region(hello.num_blocks)
        extension = (
            AckExtension(version=PROTOCOL_VERSION, transport=choice, session=hello.kvpeer.session)
            if hello.kvpeer is not None
            else None
        )
        ack = ConnectAck(peer_id=self._hello.peer_id, kvpeer=extension)
        handshake.grant(ack)
        self._transmit_now(ack)

    def _on_connect_ack(self, ack: ConnectAck) -> None:
        queued = self._handshake.answer()
        choice: TransportChoice | None = ack.kvpeer.transport if ack.kvpeer is not None else None
        self._data.peer_acknowledged(self.peer_id, choice)
        for message in queued:
            self._transmit_now(message)

    # -- sending ---------------------------------------------------------------

    def _send(self, message: Message) -> None:
        """Gate for role messages: queued until the peer acknowledged us."""
        if self._closed is not None or self._deferred_close is not None:
            return
        if not self._handshake.acknowledged:
            if not self._handshake.hold(message):
                self._deferred_close = (
                    CloseKind.UNREACHABLE,
                    f"more than {self._settings.max_queued_messages} messages queued "
                    "before the handshake completed",
                )
            return
        self._transmit_now(message)

    def _transmit_now(self, message: Message) -> None:
        if self._deferred_close is not None:
            return
        if not self._transmit(self._codec.encode(message)):
            unread = self._unread() if self._unread is not None else None
            self._deferred_close = (
                (CloseKind.OVER_BUDGET, unread)
                if unread is not None
                else (CloseKind.UNREACHABLE, "control link refused a frame")
            )
            return
        self._frames_out += 1

    def _settle_deferred_close(self) -> None:
        if self._deferred_close is not None and self._closed is None:
            kind, reason = self._deferred_close
            self._end(kind, reason, send_disconnect=False)

    def _end(
        self,
        kind: CloseKind,
        reason: str,
        *,
        send_disconnect: bool = True,
        error: BaseException | None = None,
    ) -> None:
        if self._closed is not None:
            return
        started = self._handshake.started_at is not None
        if send_disconnect and started and self._deferred_close is None:
            self._transmit(self._codec.encode(Disconnect(reason=reason[: limits.MAX_NAME_CHARS])))
        self._deferred_close = None
        registered = self._handshake.granted
        self._handshake.close()
        known = self._consumer.request_ids() if kind is CloseKind.RENEWED else ()
        loads, failed_ids = self._consumer.close(reason)
        failing = set(failed_ids)
        failed_ids.extend(kv_id for kv_id in known if kv_id not in failing)
        stores, serves = self._producer.close(reason)
        if registered:
            try:
                self._data.unregister_peer(self.peer_id)
            except DataPlaneError as exc:  # ours: the session ends all the same
                error = error or exc
                reason = f"{reason}; forgetting the peer's region failed: {exc}"
        self._closed = SessionClosed(
            kind=kind,
            reason=reason,
            loads=tuple(loads),
            stores=tuple(stores),
            failed_request_ids=tuple(failed_ids),
            unreleased_serves=tuple(serves),
            error=error,
        )


class _Guard:
    """:meth:`PeerSession._guard` as a plain context manager, one per session: a
    generator-based one would cost a generator per entry point, on every poll."""

    __slots__ = ("_session",)

    def __init__(self, session: PeerSession) -> None:
        self._session = session

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if exc is None:
            self._session._settle_deferred_close()
            return False
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not the peer's doing
        self._session._ended_by(exc)
        return True
