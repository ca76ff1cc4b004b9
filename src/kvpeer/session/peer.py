"""One peer session: handshake, gating, dispatch and error policy. Sans-IO.

The session combines a consumer role and a producer role over one control
link. It never reads a clock or touches a socket: frames come in through
:meth:`PeerSession.receive`, go out through the injected ``transmit``, and
every call that can expire something takes ``now``.

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
3. Before the peer's ``connect`` only ``connect`` and ``disconnect`` are
   accepted (anything else is a straggler: invariant 7). A second ``connect``
   is a protocol error, or a restart when it
   carries a different ``boot_id``, or - until the peer acknowledged ours -
   the very same ``connect`` again, which is acknowledged again: a peer that
   started its side over before the handshake finished (vLLM opens a session
   for every connection it accepts) asks once more for what we already granted.
   kvpeer peers number their sessions (``connect.kvpeer.session``, increasing
   per process; ``connect_ack`` echoes the number it acknowledges). Between
   two such peers, same ``boot_id``: an ack for another number than our
   connect's, or a connect with a lower number than the one we hold, belongs
   to an ended session (a straggler, invariant 7). A higher number is the
   peer's next session: the one that took ours ended and its goodbye was lost
   (a partition healed before our link noticed: seed 1614). If the peer had
   acknowledged us, or our producer role holds anything, this session ends as
   ``RENEWED`` without a goodbye (it would end the peer's new session too) and
   the owner opens a fresh one with that frame; only the ids this session held
   consumer state for fail (the peer's process and its parked PD stores live
   on). Otherwise the new connect is *adopted*: our ``connect`` is sent again
   (it went to the peer's ended session; the new one would wait for it, then
   time out: seed 25008), then the peer's is checked, registered and
   acknowledged as if first, and what we queued goes to it: when both sides
   open a fresh session from the other's connect, renewing there (every ack
   accepted) made two nodes renew each other's sessions for ever (seed 2758).
   Connects without a number (vLLM's, older kvpeer's) keep the rules above.
4. The handshake (both connects, both acks) must finish within
   ``handshake_timeout_s`` of :meth:`start`. A request does not wait that long
   on a peer that never answered: once a load or probe waits and nothing at all
   came from the peer within ``peer_wait_s`` of :meth:`start`, the session ends
   as ``UNREACHABLE`` (its queued frames are dropped unsent). Nor does it wait
   on a peer that went quiet later (frozen, partitioned): while a load or probe
   waits on a peer that answers pings (a kvpeer peer of version >=
   ``PING_VERSION``), nothing having come from it for ``peer_wait_s / 4``
   (counted from its last frame, or from when our requests began to wait if
   that is later) sends one ``ping`` - the peer's node answers at once even
   while its engine is busy - and nothing for ``peer_wait_s`` ends the session
   as ``UNREACHABLE``, with a ``disconnect`` for when the peer resumes. A
   quiet peer nobody waits on is never pinged; a peer that cannot answer pings
   (vLLM's tier) is left to the transport's heartbeat once it has spoken.
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
7. Frames carry no session identity (vLLM's do not), so a frame the peer sent
   in a session that has since ended can land in the next one - sent just
   before a crash, or crossing the goodbye that ended it. Those that cannot
   belong to this session are stragglers: dropped and counted
   (:attr:`SessionStatistics.stale_frames`), never a protocol error, and not
   heard from the peer (invariant 4's clocks ignore them). They are every frame
   but ``connect``/``disconnect`` before the peer's ``connect`` (the peer's
   session sends its ``connect`` first, and a link never reorders) and a
   ``connect_ack`` after the one we got. Ending the session for them instead
   sustained itself: the ending's goodbye crossed the next session's connect,
   whose frames landed in a session that had just ended, and two nodes ended
   each other's sessions for as long as both had requests.
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
    TransferDone,
    TransportChoice,
    Undecodable,
    UnknownMessage,
    limits,
)
from kvpeer.session.consumer import ConsumerRole, ConsumerStatistics
from kvpeer.session.greeting import incompatibility, later_session, session_number
from kvpeer.session.ports import DataPlane, HeldSupply, Parent
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
        unread: Callable[[], str | None] | None = None,
    ) -> None:
        """``held``: blocks the node keeps a copy of, served at once (producer
        invariant 9)."""
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
        self._producer = ProducerRole(peer_id, self._send, data_plane, self._settings, held)
        self._started_at: float | None = None
        self._peer_hello: Connect | None = None
        self._acked = False  # the peer acknowledged our connect
        # Our ack to the peer's connect, sent once it passed and the peer was registered.
        self._ack: ConnectAck | None = None
        self._queue: list[Message] = []
        self._deferred_close: tuple[CloseKind, str] | None = None
        self._closed: SessionClosed | None = None
        self._close_reported = False
        self._late_loads: list[LoadFinished] = []
        self._frames_in = 0
        self._frames_out = 0
        self._unknown = 0
        self._guard_cm = _Guard(self)
        self._stragglers = 0
        # Invariant 4: when the peer was last heard and our requests began
        # waiting; a ping of ours that nothing came after yet.
        self._heard_at: float | None = None
        self._wait_began = 0.0
        self._ping_out = False
        self._pings = 0

    # -- state -----------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._closed is None

    @property
    def _registered(self) -> bool:
        """The peer's connect passed and its region is registered with the data plane."""
        return self._ack is not None

    @property
    def ready(self) -> bool:
        """Handshake complete in both directions."""
        return self._acked and self._registered and self._closed is None

    @property
    def answered(self) -> bool:
        """The peer acknowledged our connect (at some point; stays True after close)."""
        return self._acked

    @property
    def peer_hello(self) -> Connect | None:
        """The peer's ``connect``, once received."""
        return self._peer_hello

    def adopts(self, hello: Connect) -> bool:
        """Invariant 3: ``hello`` opens the peer's next session and this one (not
        acknowledged, serving nothing) would take it in as a first ``connect``."""
        previous = self._peer_hello
        return (
            previous is not None
            and self._closed is None
            and not self._acked
            and self._producer.is_empty()
            and later_session(hello, previous)
        )

    @property
    def peer_boot_id(self) -> bytes | None:
        hello = self._peer_hello
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
        if not (self._acked and self._registered) and self._started_at is not None:
            deadlines.append(self._started_at + self._settings.handshake_timeout_s)
        silence = self._silence()
        if silence is not None:
            deadlines.extend(d for d in silence if d is not None)
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
            queued_messages=len(self._queue),
            pings_sent=self._pings,
            consumer=self._consumer.statistics(),
            producer=self._producer.statistics(),
        )

    # -- lifecycle -------------------------------------------------------------

    def start(self, now: float) -> None:
        """Send our ``connect``; the handshake deadline runs from here."""
        if self._started_at is not None:
            raise ProtocolError(f"session {self.peer_id} already started")
        self._started_at = now
        self._transmit_now(self._hello)
        self._settle_deferred_close()

    def receive(self, frame: bytes | bytearray | memoryview, now: float) -> None:
        """Handle one control frame from the peer."""
        self.deliver(self._codec.read(frame), now)

    def deliver(self, message: Inbound, now: float) -> None:
        """Handle one control frame from the peer that its owner decoded
        (:meth:`Codec.read`): what :meth:`receive` does, without decoding again."""
        if self._started_at is None:
            raise ProtocolError(f"session {self.peer_id}: receive() before start()")
        if self._closed is not None:
            return
        self._frames_in += 1
        with self._guard():
            if isinstance(message, Undecodable):
                raise message.error
            if self._is_straggler(message):
                self._stragglers += 1  # invariant 7: not heard, not an error
                return
            self._heard_at = now
            self._ping_out = False
            self._dispatch(message, now)

    def poll(self, now: float) -> PollResult:
        """Fire due timers and return everything that finished since last poll."""
        with self._guard():
            self._fire_timers(now)
        loads, expired = self._consumer.take_results()
        stores, fetched = self._producer.take_results()
        prefilled = tuple(kv_id for kv_id, done in fetched if done)
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
            prefilled_ids=prefilled,
            expired_probe_ids=tuple(expired),
            closed=closed,
            lookup_seconds=tuple(lookup_seconds),
        )

    def _fire_timers(self, now: float) -> None:
        if self._closed is None:
            silence = self._silence()
            if silence is not None and now >= silence[0]:
                heard = self._heard_at is not None
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
            elif (
                not (self._acked and self._registered)
                and self._started_at is not None
                and now >= self._started_at + self._settings.handshake_timeout_s
            ):
                self._end(
                    CloseKind.TIMEOUT,
                    f"handshake not complete within {self._settings.handshake_timeout_s:g}s",
                    send_disconnect=True,
                )
            else:
                if silence is not None and silence[1] is not None and now >= silence[1]:
                    self._ping_out = True
                    self._pings += 1
                    self._transmit_now(Ping())
                self._consumer.tick(now)
                self._producer.tick(now)

    def _silence(self) -> tuple[float, float | None] | None:
        """Invariant 4, while a request waits: when to give the peer up, and when
        to ping it first (None: no ping due)."""
        if self._started_at is None or not self._consumer.waits_on_peer():
            return None
        wait = self._settings.peer_wait_s
        if self._heard_at is None:
            return self._started_at + wait, None
        if not self._peer_at_least(PING_VERSION):
            return None  # it cannot be asked: the transport's heartbeat decides
        quiet_from = max(self._heard_at, self._wait_began)
        ping_due = self._acked and not self._ping_out
        return quiet_from + wait, quiet_from + wait / 4 if ping_due else None

    def _peer_at_least(self, version: tuple[int, int]) -> bool:
        ext = self._peer_hello.kvpeer if self._peer_hello is not None else None
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
        if self._closed is None:
            with self._guard():
                self._consumer.flush()

    def request_blocks(
        self,
        job_id: int,
        kv_request_id: str,
        keys: Sequence[Key],
        slots: Sequence[int],
        now: float,
        **flags: bool,  # the fetch's: prefill_done, resolve (ConsumerRole.request_blocks)
    ) -> None:
        if self._closed is not None:
            self._late_loads.append(
                LoadFinished(job_id, kv_request_id, False, f"session closed: {self._closed.reason}")
            )
            return
        # Not guarded: a bad job is the engine's mistake (ProtocolError to the owner).
        self._note_wait(now)
        self._consumer.request_blocks(job_id, kv_request_id, keys, slots, now, **flags)
        self._settle_deferred_close()

    def _note_wait(self, now: float) -> None:
        """A load or probe is about to wait: if none waited, the quiet clock starts now."""
        if not self._consumer.waits_on_peer():
            self._wait_began = now
            self._ping_out = False

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

    def _is_straggler(self, message: Message | UnknownMessage) -> bool:
        """Invariant 7: a frame that cannot belong to this session."""
        if isinstance(message, Connect):
            previous = self._peer_hello  # an older session's, late (invariant 3)
            return previous is not None and later_session(previous, message)
        if isinstance(message, Disconnect | UnknownMessage):
            return False
        if self._peer_hello is None:
            return True  # the peer's session sends its connect first
        if not isinstance(message, ConnectAck):
            return False
        if self._acked:
            return True
        ours = session_number(self._hello)
        acked = message.kvpeer.session if message.kvpeer is not None else None
        return ours is not None and acked is not None and acked != ours  # invariant 3

    def _dispatch(self, message: Message | UnknownMessage, now: float) -> None:
        if isinstance(message, UnknownMessage):
            self._unknown += 1
            return
        if isinstance(message, Connect):
            self._on_connect(message)
            return
        if isinstance(message, Disconnect):
            why = message.reason or "no reason given"
            self._end(CloseKind.DISCONNECTED, f"peer disconnected: {why}", send_disconnect=False)
            return
        if self._peer_hello is None:
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
        previous = self._peer_hello
        if previous is not None:
            old = previous.kvpeer.boot_id if previous.kvpeer is not None else None
            new = hello.kvpeer.boot_id if hello.kvpeer is not None else None
            if old is not None and new is not None and old != new:
                self._end(
                    CloseKind.RESTARTED, "peer restarted (new boot id)", send_disconnect=False
                )
                return
            if later_session(hello, previous):  # invariant 3: the peer's next session
                if not self.adopts(hello):
                    self._end(
                        CloseKind.RENEWED,
                        "peer began a new session (same boot id; its side of this one ended)",
                        send_disconnect=False,
                    )
                    return
                # Adopted: checked and registered afresh (the registration replaces
                # the last; the windows our queued fetches opened stay open).
                self._ack = None
                self._peer_hello = None
                self._transmit_now(self._hello)  # its session never got ours (seed 25008)
                self._on_connect(hello)
                return
            if hello == previous and self._ack is not None:
                # invariant 3: the same grant again. Also after the handshake: a peer
                # whose ack came late re-sends the very same connect (vLLM's p2p tier
                # does under load); answering it is idempotent, ending the session is not.
                self._transmit_now(self._ack)
                return
            raise ProtocolError("duplicate connect")
        self._peer_hello = hello
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
        self._ack = ConnectAck(peer_id=self._hello.peer_id, kvpeer=extension)
        self._transmit_now(self._ack)

    def _on_connect_ack(self, ack: ConnectAck) -> None:
        self._acked = True
        choice: TransportChoice | None = ack.kvpeer.transport if ack.kvpeer is not None else None
        self._data.peer_acknowledged(self.peer_id, choice)
        queued, self._queue = self._queue, []
        for message in queued:
            self._transmit_now(message)

    # -- sending ---------------------------------------------------------------

    def _send(self, message: Message) -> None:
        """Gate for role messages: queued until the peer acknowledged us."""
        if self._closed is not None or self._deferred_close is not None:
            return
        if not self._acked:
            if len(self._queue) >= self._settings.max_queued_messages:
                self._deferred_close = (
                    CloseKind.UNREACHABLE,
                    f"more than {self._settings.max_queued_messages} messages queued "
                    "before the handshake completed",
                )
                return
            self._queue.append(message)
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
        if send_disconnect and self._started_at is not None and self._deferred_close is None:
            self._transmit(self._codec.encode(Disconnect(reason=reason[: limits.MAX_NAME_CHARS])))
        self._deferred_close = None
        self._queue = []
        known = self._consumer.request_ids() if kind is CloseKind.RENEWED else ()
        loads, failed_ids = self._consumer.close(reason)
        failing = set(failed_ids)
        failed_ids.extend(kv_id for kv_id in known if kv_id not in failing)
        stores, serves = self._producer.close(reason)
        if self._registered:
            self._ack = None
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
    """:meth:`PeerSession._guard` as a plain context manager, one per session (the
    generator-based kind cost a generator per entry point, on every poll)."""

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
