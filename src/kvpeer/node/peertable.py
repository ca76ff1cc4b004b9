"""The peer table: one :class:`PeerSession` per peer, who may have one, and how it ends.

It admits peers (allow-list, our own identity, the source address a session is
bound to, the peer cap with eviction, handshakes per source), routes each
inbound frame to its session, remembers the connects it refused and backs off
peers that could not be reached (:mod:`kvpeer.node.peermemory`), holds a
registering peer's frames (:mod:`kvpeer.node.registering`), opens a fresh
session when a peer restarted and says goodbye on a fresh link when ours
broke. Each inbound frame is decoded
once (:meth:`Codec.read`) and handed on as a value. What sessions' polls yield
(results, a close) is returned as :class:`Polled` values for the tier to apply;
a session whose poll says it closed has been dropped from the table by then.

Invariants:

1. Only a peer's ``connect`` opens a session; other frames from a peer with no
   live session are stragglers of an ended one and are dropped (counted; inside
   a live session, the session drops those that cannot belong to it: its
   invariant 7). Once
   the session ended ``peer_wait_s`` ago or more (stragglers in flight have
   arrived by then), a peer still sending into it holds a session we forgot -
   its goodbye was lost, e.g. in a partition that healed between the two ends'
   heartbeat timeouts - and would wait out the timeouts of every request it
   sends: it gets a ``disconnect`` on its own connection (never a dial). At
   most ``4 * max_peers`` end times are remembered.
2. A session that ended because our link to the peer broke (or gave the peer
   up for not reading: ``over_budget``) says goodbye on a
   fresh link (best effort, once): the peer's link to us may still work, and a
   vLLM peer, which never reads answers on its own connection, would otherwise
   keep the session, wait out each load it sends us and take our next
   ``connect`` for a duplicate.
3. A peer's ``connect`` identical to one we refused within ``handshake_timeout_s``
   (but for its session number) is refused on the peer's own connection without
   opening a session: a vLLM peer
   answers our goodbye with a new session and the same ``connect``, and opening
   a session for it (our ``connect``, then our goodbye) would loop. At most
   ``max_peers`` refusals are remembered; they expire.
4. Nothing a peer names is dialed blindly, ourselves least of all (frames under
   our own identity are dropped). A session an inbound peer opens is
   dialed back at the identity it claims only if that identity's host is the
   IP address its connection comes from (unless ``trust_peer_addresses``).
   A session is bound to the first address its peer's frames came from;
   frames under its identity from elsewhere are dropped.
5. One source address holds at most ``max_handshakes_per_source`` sessions
   still in their handshake; a connect beyond that is refused, and eviction
   takes handshaking sessions of the busiest source first, so one address
   cannot flood everyone else out.
6. At most ``max_peers`` sessions. When full, an idle one is evicted (still in
   its handshake first, then the least recently used); never one with work in
   flight, nor a ready one a live request pulls from. With none to evict the
   new peer is refused.
7. A peer whose session ended unreachable (or timed out) before it ever
   acknowledged us is backed off: requests naming it compute locally at once
   until its retry time, which doubles from :data:`FIRST_RETRY_S` up to
   ``peer_retry_max_s`` with each failed attempt; the first session that
   completes its handshake clears it. At most ``4 * max_peers`` are remembered.
8. A ``connect`` with a new boot id ends the old session (``RESTARTED``) and
   the same frame opens a fresh one at once; so does a kvpeer peer's
   ``connect`` numbering a later session after it acknowledged ours
   (``RENEWED``: the peer's next session, its goodbye for the last one lost;
   session invariant 3), and a ``connect`` whose session ends ``UNREACHABLE`` as
   it takes it in (our own link to the peer died, seen when the answer could not
   be sent): the connect proves the peer is there, and a fresh session on a new
   link answers it (dropped, both sides would wait for the other's connect until
   their handshakes timed out). Our connects
   number our sessions in increasing order, from a start drawn from our boot id.
9. A peer's ``connect`` that a session will register with the data plane (its
   first, or its next session's that an unacknowledged session adopts), when the
   registration may be slow (a NIXL metadata load, an shm region request), is
   registered off the node's lock (:meth:`NodeDataPlane.prepare_peer`): the frame,
   and every later frame of that peer (at most ``MAX_HELD_FRAMES`` frames and
   ``max_peer_bytes`` bytes; the rest dropped as strays), is held, in order
   (:mod:`kvpeer.node.registering`), and
   routed again by the first poll after the registration is ready; after
   ``handshake_timeout_s`` they are dropped (the peer's handshake times out and it
   tries again). Frames of other peers flow meanwhile, and engine calls do not wait
   for the registration.

Every method runs under the node's lock (it is called by the tier only).
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from kvpeer.config import TierConfig
from kvpeer.errors import PeerLost
from kvpeer.node.counters import TierCounters
from kvpeer.node.params import split_peer_id
from kvpeer.node.peermemory import FIRST_RETRY_S, PeerMemory
from kvpeer.node.peerview import PeerView, peer_views
from kvpeer.node.registering import HeldFrames
from kvpeer.node.trace import Trace
from kvpeer.protocol import (
    PROTOCOL_VERSION,
    Codec,
    Connect,
    ConnectExtension,
    Disconnect,
    Inbound,
    Prefetch,
    PrefetchRefused,
)
from kvpeer.session import CloseKind, PeerSession, PollResult, SessionClosed
from kvpeer.session.ports import EngineSteps, HeldSupply
from kvpeer.transport.base import ControlLink, ControlTransport, InboundFrame, NodeDataPlane
from kvpeer.types import StoreJob, TransferJob

__all__ = [
    "FIRST_RETRY_S",
    "Opened",
    "Peer",
    "PeerTable",
    "PeerTableStatistics",
    "PeerView",
    "Polled",
]

log = logging.getLogger("kvpeer.tier")  # the tier's log: operators grep one name

DEFAULT_HASH_SEED = "vllm-none-hash"


@dataclass(slots=True)
class Peer:
    """One peer's session and our control link to it."""

    session: PeerSession
    link: ControlLink
    last_used: float
    #: The address the peer's frames come from, once one arrived (invariant 4).
    source: str | None = None
    #: When the session opened, and when a frame of the peer last arrived.
    opened_at: float = 0.0
    last_heard: float | None = None
    #: Blocks this peer's loads brought us (the tier counts them).
    blocks_pulled: int = 0
    #: Since when peer work waits for the engine's serve window (None: nothing waits).
    serve_wait_since: float | None = None


@dataclass(frozen=True, slots=True)
class PeerTableStatistics:
    sessions: int
    peers_refused: int  # since start: peers refused a session (or frames refused)
    stray_frames: int  # since start: frames from peers without a live session
    refusals_remembered: int
    backed_off: int


@dataclass(frozen=True, slots=True)
class Polled:
    """What one session's poll yielded, for the tier to apply. With
    ``result.closed`` the session ended: the table has dropped it already."""

    peer_id: str
    peer: Peer
    result: PollResult


class Opened(NamedTuple):
    """:meth:`PeerTable.open`: the live session (None: refused), and what the sessions
    it ended to make room (a dead one of the same peer, an evicted one) yielded."""

    peer: Peer | None
    polled: list[Polled]


class PeerTable:
    """Sessions by peer id, and the rules for opening and ending them."""

    def __init__(
        self,
        config: TierConfig,
        control: ControlTransport,
        data_plane: NodeDataPlane,
        counters: TierCounters,
        *,
        pulled_from: Callable[[], Collection[str]],
        hash_seed: str | Callable[[], str] | None = None,
        boot_id: bytes | None = None,
        trace: Trace | None = None,
        held: HeldSupply | None = None,
        engine: EngineSteps | None = None,
    ) -> None:
        """``pulled_from`` names the peers live requests pull from (eviction spares
        them); ``hash_seed`` may be a callable, resolved when the first session
        opens (vLLM knows its prefix-hash seed only after the tier was built)."""
        self._config = config
        self._held_blocks = held
        self._engine = engine
        self._settings = config.session_settings()
        self._control = control
        self._data = data_plane
        self._trace = trace or Trace(control.local_id)
        self._session_data = self._trace.wrap_data_plane(data_plane)
        self._counters = counters
        self._pulled_from = pulled_from
        self._hash_seed_source = config.hash_seed or hash_seed or DEFAULT_HASH_SEED
        self._hash_seed: str | None = None
        self._boot_id = boot_id or os.urandom(16)
        # Our connects' ``session``: increasing, from a start drawn from the boot id so
        # that an ack meant for another incarnation of ours does not match (56 bits).
        self._session_numbers = itertools.count(int.from_bytes(self._boot_id[:7], "big"))
        self._codec = Codec()
        self._peers: dict[str, Peer] = {}
        self._refused = 0
        self._stray = 0  # frames from peers without a live session (not a connect)
        self._prefetches: list[tuple[InboundFrame, Prefetch]] = []
        self._memory = PeerMemory(config)  # refused connects, back-offs, endings
        self._held = HeldFrames(config.max_peer_bytes, config.handshake_timeout_s)

    # -- the table ------------------------------------------------------------------

    def get(self, peer_id: str) -> Peer | None:
        """The session toward ``peer_id`` (maybe no longer alive), if any."""
        return self._peers.get(peer_id)

    def __len__(self) -> int:
        return len(self._peers)

    def __iter__(self) -> Iterator[Peer]:
        return iter(self._peers.values())

    def items(self) -> list[tuple[str, Peer]]:
        """A snapshot: safe to iterate while sessions end."""
        return list(self._peers.items())

    def next_deadline(self) -> float | None:
        sessions = (d for p in self._peers.values() if (d := p.session.next_deadline()) is not None)
        held = self._held.deadlines()
        return min((*sessions, *held), default=None)

    # -- opening ----------------------------------------------------------------------

    def open(self, peer_id: str, now: float) -> Opened:
        """The live session toward ``peer_id``, opened if allowed and room permits."""
        polled: list[Polled] = []
        return Opened(self._open(peer_id, now, None, polled), polled)

    def _open(
        self, peer_id: str, now: float, source: str | None, polled: list[Polled]
    ) -> Peer | None:
        peer = self._peers.get(peer_id)
        if peer is not None:
            if peer.session.alive:
                return peer
            polled.append(self._reap(peer_id, peer, now))  # the dead one first
        address = split_peer_id(peer_id)
        if (
            address is None
            or peer_id == self._control.local_id
            or not self._config.allowed_peers.allows(*address)
        ):
            self._refused += 1
            return None
        if len(self._peers) >= self._config.max_peers and not self._evict_idle(now, polled):
            self._refused += 1
            return None
        link = self._control.connect(peer_id)
        self._data.grant(peer_id)
        send = self._trace.wrap_send(peer_id, link.transmit)
        session = PeerSession(
            peer_id,
            self._hello(),
            self._session_data,
            send,
            self._settings,
            held=self._held_blocks,
            engine=self._engine,
            unread=lambda: link.unread,
        )
        peer = Peer(session, link, now, source, opened_at=now)
        self._peers[peer_id] = peer
        self._counters.sessions_opened += 1
        session.start(now)
        return peer

    def _evict_idle(self, now: float, polled: list[Polled]) -> bool:
        # Sessions still in their handshake go first, then the least recently used;
        # never one with work in flight, nor a ready one a live request pulls from.
        # Among handshaking ones, those of the source holding the most go first.
        needed = self._pulled_from()
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
        polled.append(self._reap(peer_id, peer, now))
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
                session=next(self._session_numbers),
            ),
        )

    # -- inbound frames ------------------------------------------------------------------

    def route(self, inbound: InboundFrame, now: float) -> list[Polled]:
        """Deliver a frame to its peer's session, opening one for an admitted
        ``connect``; a session the frame ended is polled (and dropped) at once."""
        polled: list[Polled] = []
        self._route(inbound, self._codec.read(inbound.frame), now, polled)
        return polled

    def _route(
        self, inbound: InboundFrame, message: Inbound, now: float, polled: list[Polled]
    ) -> None:
        peer_id = inbound.peer_id
        if peer_id == self._control.local_id:
            self._stray += 1  # someone using our own identity: never a session with us
            return
        if isinstance(message, Prefetch):
            self._prefetches.append((inbound, message))  # a router's, outside any session
            return
        if self._held.holds(peer_id):  # invariant 9: after its connect, in order
            if not self._held.add(peer_id, inbound, message):
                self._stray += 1
            return
        source = _canonical_ip(inbound.source)
        if source is not None and not self._config.allowed_peers.allows_source(source):
            self._refused += 1
            self._refuse(peer_id, message, f"connections from {source} are not in allowed_peers")
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
            if not isinstance(message, Connect):
                self._stray += 1
                ended = self._memory.ended_at(peer_id)
                if ended is not None and now >= ended + self._config.peer_wait_s:
                    self._refuse(peer_id, message, "no session with you (it ended)", quiet=True)
                return
            refused = self._memory.refused_before(peer_id, message, inbound.frame, now)
            if refused is not None:
                self._refused += 1
                self._refuse(peer_id, message, f"{refused} (this connect was refused before)")
                return
            problem = self._inbound_problem(peer_id, source)
            if problem is not None:
                self._refused += 1
                self._refuse(peer_id, message, problem)
                return
            peer = self._open(peer_id, now, source, polled)
            if peer is None:
                self._refuse(peer_id, message, "peer not allowed, or the peer cap is reached")
                return
        if self._held_for_registration(peer_id, peer, inbound, message, now):
            return
        peer.last_used = peer.last_heard = now
        if self._trace.enabled:
            self._trace.received(peer_id, message)
        peer.session.deliver(message, now)
        if not peer.session.alive:
            reaped = self._reap(peer_id, peer, now)
            polled.append(reaped)
            closed = reaped.result.closed
            if closed is not None and closed.kind is CloseKind.REJECTED:
                self._remember_refusal(peer_id, inbound.frame, message, closed.reason, now)
            if closed is not None and (
                closed.kind in (CloseKind.RESTARTED, CloseKind.RENEWED)
                or (closed.kind is CloseKind.UNREACHABLE and isinstance(message, Connect))
            ):
                log.info("peer %s %s; opening a fresh session", peer_id, closed.kind.value)
                fresh = self._open(peer_id, now, source, polled)
                if fresh is not None and not self._held_for_registration(
                    peer_id, fresh, inbound, message, now
                ):
                    fresh.session.deliver(message, now)

    def _held_for_registration(
        self, peer_id: str, peer: Peer, inbound: InboundFrame, message: Inbound, now: float
    ) -> bool:
        """Invariant 9: hold ``inbound`` if it is a connect that ``peer``'s session
        will register (a first one, or the peer's next session it adopts) and the
        data plane registers it off the lock."""
        session = peer.session
        if session.peer_hello is not None and session.answered:
            return False  # registered, acknowledged: a connect now renews or is refused
        if not isinstance(message, Connect):
            return False
        if session.peer_hello is not None and not session.adopts(message):
            return False
        if self._data.prepare_peer(peer_id, message):
            return False
        self._held.start(peer_id, inbound, message, now)
        return True

    def _release_held(self, now: float) -> Iterator[Polled]:
        """Route the frames of peers whose registration is ready (invariant 9)."""
        for peer_id, frames, timed_out in self._held.release(now, self._data.preparing):
            if timed_out:
                self._stray += len(frames)
                log.warning(
                    "registering %s took over %.1f s (handshake_timeout_s): dropped its %d "
                    "frames; it will connect again", peer_id,
                    self._config.handshake_timeout_s, len(frames),
                )  # fmt: skip
                continue
            for inbound, message in frames:
                polled: list[Polled] = []
                self._route(inbound, message, now, polled)
                yield from polled
            self._data.settle_peer(peer_id)

    def _inbound_problem(self, peer_id: str, source: str | None) -> str | None:
        """Why an inbound peer may not open a session (invariants 4 and 5), or None."""
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

    def _remember_refusal(
        self, peer_id: str, frame: bytes, message: Inbound, reason: str, now: float
    ) -> None:
        """Invariant 3: ``message`` (a connect) made us refuse ``peer_id``."""
        if isinstance(message, Connect):
            self._memory.remember_refusal(peer_id, message, frame, reason, now)

    def _refuse(self, peer_id: str, message: Inbound, reason: str, *, quiet: bool = False) -> None:
        """Tell a peer we will not talk to it, on its own connection (never dial it)."""
        if isinstance(message, Disconnect):
            return  # never answer a goodbye: two refusing nodes would ping-pong
        if not quiet:
            log.warning("refusing %s: %s", peer_id, reason)
        self._control.refuse(peer_id, self._codec.encode(Disconnect(reason=reason)))

    def take_prefetches(self) -> list[tuple[InboundFrame, Prefetch]]:
        """Routers' prefetches received since the last call (kvpeer.node.ahead)."""
        taken, self._prefetches = self._prefetches, []
        return taken

    def refuse_prefetch(self, inbound: InboundFrame, message: Prefetch, reason: str) -> None:
        """Answer a prefetch with a named refusal, on the sender's own connection."""
        log.info("prefetch %s from %s refused: %s", message.kv_request_id[:64],
                 inbound.source or inbound.peer_id[:64], reason)  # fmt: skip
        refusal = PrefetchRefused(kv_request_id=message.kv_request_id, reason=reason[:512])
        self._control.refuse(inbound.peer_id, self._codec.encode(refusal))

    # -- polling and ending ------------------------------------------------------------------

    def poll(self, now: float) -> Iterator[Polled]:
        """Poll every session (a broken link ends its session): what each yielded,
        one session at a time as the caller iterates, so that what the caller does
        with one (a fetch bound to parked stores starts a write) comes before the
        next session's poll. Held frames whose registration is ready are routed
        first (invariant 9)."""
        if self._held:
            yield from self._release_held(now)
        for peer_id, peer in list(self._peers.items()):
            if not peer.link.alive and peer.session.alive:
                peer.session.close("control link lost", CloseKind.UNREACHABLE)
            yield self._reap(peer_id, peer, now)

    def close_all(self, reason: str, now: float) -> list[Polled]:
        """End every session (the tier shuts down): what each yielded."""
        polled: list[Polled] = []
        for peer_id, peer in list(self._peers.items()):
            peer.session.close(reason)
            polled.append(self._reap(peer_id, peer, now))
        return polled

    def _reap(self, peer_id: str, peer: Peer, now: float) -> Polled:
        """Poll ``peer``'s session; if it closed, end it here."""
        result = peer.session.poll(now)
        if result.closed is not None:
            self._ended(peer_id, peer, result.closed, now)
        return Polled(peer_id, peer, result)

    def _ended(self, peer_id: str, peer: Peer, closed: SessionClosed, now: float) -> None:
        """``peer``'s session ended: drop it, close its link, then back the peer off
        or say goodbye (invariants 2 and 7)."""
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
        if self._peers.get(peer_id) is peer:
            del self._peers[peer_id]
            self._data.revoke(peer_id)
        self._memory.session_ended(peer_id, now)
        unreachable = closed.kind in (CloseKind.UNREACHABLE, CloseKind.TIMEOUT)
        # Keep the connection for our next link only toward the same, live process: not
        # toward a silent peer, nor one that restarted (its connection went with the
        # old process: taken over, the fresh session's frames followed it, and ZMQ's
        # reconnect to the new one then ended that session too).
        peer.link.close(park=not unreachable and closed.kind is not CloseKind.RESTARTED)
        if unreachable and not peer.session.answered:
            self._memory.back_off(peer_id, now)  # and no goodbye: nobody to hear it
        elif closed.kind is CloseKind.UNREACHABLE or peer.link.unread is not None:
            self._say_goodbye(peer_id, closed.reason)

    def _say_goodbye(self, peer_id: str, reason: str) -> None:
        """A ``disconnect`` on a fresh link to ``peer_id``, which then closes (its
        queued frame still goes out; see invariant 2)."""
        try:
            link = self._control.connect(peer_id)
        except PeerLost:
            return
        link.transmit(self._codec.encode(Disconnect(reason=f"session ended: {reason}")))
        link.close(park=False)

    def expire(self, now: float) -> None:
        """Forget refused connects whose time is up (invariant 3)."""
        self._memory.expire(now)

    # -- back-off ----------------------------------------------------------------------

    def backed_off(self, peer_id: str, now: float) -> bool:
        """Invariant 7: no new session toward ``peer_id`` yet."""
        peer = self._peers.get(peer_id)
        answered = peer is not None and peer.session.answered
        return self._memory.backed_off(peer_id, now, answered=answered)

    # -- Suppliers (the producer bindings reach sessions through these) ----------------

    def add_supply(self, peer_id: str, kv_request_id: str, job: TransferJob, now: float) -> bool:
        peer = self._peers.get(peer_id)
        if peer is None:
            return False
        peer.last_used = now
        if self._trace.enabled:
            self._trace.supplying(peer_id, kv_request_id)
        return peer.session.add_supply(
            kv_request_id, StoreJob(job.job_id, job.keys, job.slots), now
        )

    def finish_supply(self, peer_id: str, kv_request_id: str, now: float) -> None:
        peer = self._peers.get(peer_id)
        if peer is not None:
            peer.session.finish_supply(kv_request_id, now)

    def serves(self, peer_id: str) -> bool:
        peer = self._peers.get(peer_id)
        return peer is not None and peer.session.alive

    # -- statistics ----------------------------------------------------------------------

    def statistics(self) -> PeerTableStatistics:
        return PeerTableStatistics(
            sessions=len(self._peers),
            peers_refused=self._refused,
            stray_frames=self._stray,
            refusals_remembered=self._memory.refusals,
            backed_off=self._memory.backoffs,
        )

    def view(self, now: float, limit: int) -> tuple[list[PeerView], int]:
        """At most ``limit`` peers (sessions, then backed-off peers without one,
        each by peer id) and how many there are in all."""
        return peer_views(self._peers, self._memory, now, limit)


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
