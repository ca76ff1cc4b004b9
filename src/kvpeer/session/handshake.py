"""One session's handshake and renewal: its phase, what a peer's ``connect`` means. Sans-IO.

The session's :class:`Phase` is one value: ``NEW`` until :meth:`Handshake.start`,
``GREETING`` once our ``connect`` went, ``GRANTED`` once the peer's ``connect``
was checked, registered and acknowledged by us, ``READY`` once the peer
acknowledged ours, ``CLOSED`` at the end (:class:`kvpeer.session.peer.PeerSession`
owns the ending). The peer's ack of ours cannot come first: its ``connect``
precedes it on the link (an ack before it is a straggler, invariant 7). The
session acts on
what :meth:`Handshake.verdict` says of a peer's ``connect``; this module sends
nothing itself.

Invariants (numbered as the session's, ``kvpeer.session.peer``):

1. Our ``connect`` is the first frame we send. Everything else waits in a
   bounded queue until the peer's ``connect_ack`` (:meth:`Handshake.hold`).
2. The peer's ``connect`` is checked (block length, fingerprint, hash seed,
   the admit callback), its region is registered with the data plane, and
   only then is it acknowledged: our ack promises that we can write into the
   peer's memory safely.
3. Before the peer's ``connect`` only ``connect`` and ``disconnect`` are
   accepted (anything else is a straggler: invariant 7). A second ``connect``
   is a protocol error (``DUPLICATE``), or a restart when it carries a
   different ``boot_id`` (``RESTARTED``), or - once we granted the first - the
   very same ``connect`` again, which is acknowledged again (``REPEATED``): a
   peer that started its side over before the handshake finished, or whose
   ack came late, asks once more for what we already granted. kvpeer peers
   number their sessions (``connect.kvpeer.session``, increasing per process;
   ``connect_ack`` echoes the number it acknowledges). Between two such peers,
   same ``boot_id``: an ack for another number than our connect's, or a
   connect with a lower number than the one we hold, belongs to an ended
   session (a straggler, invariant 7). A higher number is the peer's next
   session: the one that took ours ended and its goodbye was lost. If the peer
   had acknowledged us, or our producer role holds anything, this session ends
   as ``RENEWED`` without a goodbye (it would end the peer's new session too)
   and the owner opens a fresh one with that frame; only the ids this session
   held consumer state for fail (the peer's process and its parked PD stores
   live on). Otherwise the new connect is *adopted* (``ADOPTED``): our
   ``connect`` is sent again (it went to the peer's ended session; the new one
   waits for it), then the peer's is checked, registered and acknowledged as
   if first, and what we queued goes to it. Connects without a number
   (vLLM's, older kvpeer's) keep the rules above.
7. Frames carry no session identity (vLLM's do not), so a frame the peer sent
   in a session that has since ended can land in the next one. Those that
   cannot belong to this session are stragglers (:meth:`Handshake.is_straggler`):
   every frame but ``connect``/``disconnect`` before the peer's ``connect``
   (the peer's session sends its ``connect`` first, and a link never
   reorders), a ``connect_ack`` after the one we got, and a ``connect`` or
   ``connect_ack`` of an older session number. They are dropped and counted,
   never a protocol error.
"""

from __future__ import annotations

import enum

from kvpeer.protocol import Connect, ConnectAck, Disconnect, Inbound, Message, UnknownMessage
from kvpeer.session.greeting import later_session, session_number

__all__ = ["Handshake", "Phase", "Verdict"]


class Phase(enum.Enum):
    """Where one session is in its life."""

    NEW = "new"  # not started: nothing sent
    GREETING = "greeting"  # our connect sent; the peer's not granted yet
    GRANTED = "granted"  # we acknowledged the peer's connect; ours not acknowledged yet
    READY = "ready"  # both halves done
    CLOSED = "closed"


class Verdict(enum.Enum):
    """What a peer's ``connect`` means to this session (invariant 3)."""

    FIRST = "first"  # check, register and acknowledge it
    ADOPTED = "adopted"  # the peer's next session, taken in: our connect again, then FIRST
    REPEATED = "repeated"  # the very connect we granted: our ack again
    RESTARTED = "restarted"  # a new boot id: the session ends
    RENEWED = "renewed"  # the peer's next session after ours was answered: the session ends
    DUPLICATE = "duplicate"  # a protocol error


_GRANTED = frozenset((Phase.GRANTED, Phase.READY))


class Handshake:
    """Our ``connect``, the peer's, the grant and the queue that waits for the ack."""

    def __init__(self, hello: Connect, max_queued: int) -> None:
        self.hello = hello
        self.phase = Phase.NEW
        self.started_at: float | None = None
        #: The peer's ``connect``, once received (kept after the session closed).
        self.peer_hello: Connect | None = None
        #: Our ack of the peer's connect, once it passed and the peer was registered.
        self.ack: ConnectAck | None = None
        #: The peer acknowledged our connect at some point (kept after the session closed).
        self.answered = False
        self._queue: list[Message] = []
        self._max_queued = max_queued

    # -- phases ------------------------------------------------------------------

    def start(self, now: float) -> None:
        self.started_at = now
        if self.phase is Phase.NEW:
            self.phase = Phase.GREETING

    @property
    def acknowledged(self) -> bool:
        """The peer acknowledged our connect (this session is not closed)."""
        return self.phase is Phase.READY

    @property
    def granted(self) -> bool:
        """We acknowledged the peer's connect: its region is registered."""
        return self.phase in _GRANTED

    def deadline(self, timeout_s: float) -> float | None:
        """When the handshake must be complete (invariant 4), while it is not."""
        if self.started_at is None or self.phase in (Phase.READY, Phase.CLOSED):
            return None
        return self.started_at + timeout_s

    def grant(self, ack: ConnectAck) -> None:
        """The peer's connect passed and is registered: ``ack`` goes out."""
        self.ack = ack
        self.phase = Phase.GRANTED

    def answer(self) -> list[Message]:
        """The peer acknowledged our connect: what waited for that, in order."""
        assert self.phase is Phase.GRANTED, "an ack before the peer's connect is a straggler"
        self.answered = True
        self.phase = Phase.READY
        queued, self._queue = self._queue, []
        return queued

    def forget_peer(self) -> None:
        """Adoption (invariant 3): the peer's next connect is taken in as a first one;
        the registration it brings replaces the last."""
        self.ack = None
        self.peer_hello = None
        self.phase = Phase.GREETING

    def close(self) -> None:
        self.ack = None
        self._queue = []
        self.phase = Phase.CLOSED

    # -- the queue (invariant 1) ---------------------------------------------------

    def hold(self, message: Message) -> bool:
        """Queue ``message`` until the peer acknowledged us; False: the queue is full."""
        if len(self._queue) >= self._max_queued:
            return False
        self._queue.append(message)
        return True

    @property
    def queued(self) -> int:
        return len(self._queue)

    # -- the peer's frames -----------------------------------------------------------

    def adopts(self, hello: Connect) -> bool:
        """``hello`` opens the peer's next session and this one (not acknowledged) may
        take it in as a first connect - if its producer role serves nothing."""
        previous = self.peer_hello
        return (
            previous is not None
            and self.phase in (Phase.GREETING, Phase.GRANTED)
            and later_session(hello, previous)
        )

    def verdict(self, hello: Connect, serving_nothing: bool) -> Verdict:
        """What the peer's ``hello`` means (invariant 3); ``serving_nothing``: our
        producer role holds nothing for the peer."""
        previous = self.peer_hello
        if previous is None:
            return Verdict.FIRST
        old = previous.kvpeer.boot_id if previous.kvpeer is not None else None
        new = hello.kvpeer.boot_id if hello.kvpeer is not None else None
        if old is not None and new is not None and old != new:
            return Verdict.RESTARTED
        if later_session(hello, previous):
            return Verdict.ADOPTED if serving_nothing and self.adopts(hello) else Verdict.RENEWED
        if hello == previous and self.ack is not None:
            return Verdict.REPEATED
        return Verdict.DUPLICATE

    def is_straggler(self, message: Inbound) -> bool:
        """Invariant 7: a frame that cannot belong to this session."""
        if isinstance(message, Connect):
            previous = self.peer_hello  # an older session's, late (invariant 3)
            return previous is not None and later_session(previous, message)
        if isinstance(message, Disconnect | UnknownMessage):
            return False
        if self.peer_hello is None:
            return True  # the peer's session sends its connect first
        if not isinstance(message, ConnectAck):
            return False
        if self.answered:
            return True
        ours = session_number(self.hello)
        acked = message.kvpeer.session if message.kvpeer is not None else None
        return ours is not None and acked is not None and acked != ours  # invariant 3
