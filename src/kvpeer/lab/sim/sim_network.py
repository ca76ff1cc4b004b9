"""The simulation's control network: ZMQ-over-TCP failure semantics in simulated time.

The in-memory network of the test kit (:class:`kvpeer.testing.network.ControlNetwork`:
nodes by id, inboxes of frames due at a time) with the faults below. Each node
attaches with its peer id and gets a :class:`SimControl` (the
:class:`~kvpeer.transport.base.ControlTransport` contract); attaching again under the
same id is a restart on the same address (a new incarnation). Frames on a link keep
their order and spend ``delay(sender, receiver)`` in flight. Frames from one node to
one incarnation of another keep their order across links too: a node's next link to a
peer never delivers before what its earlier links already sent there
(``kvpeer.transport.zmq_control`` rules 6 and 7: the next link rides the parked
connection after its last words, or the peer's ROUTER reads a fresh connection only
once it let go of the old one, or - with handover - after the frames already in the
old one). The faults, and what a node sees of them (``kvpeer.transport.zmq_control``
rule 3: a link that loses its connection is dead, never reconnected):

1. **Death** (:meth:`SimNetwork.kill`, the process vanished but its host is
   up; attaching again is a restart on the same address): links toward it
   are dead at the next :meth:`SimNetwork.update` (the kernel resets the
   connection), and so is a link dialled to it while it is down (connection
   refused) - unless the path is cut (3): then the reset never arrives and
   the link dies like any other behind a cut.
2. **No host** (an id nobody ever attached): a link toward it never connects
   and never dies; its frames vanish (SYNs lost, no answer ever).
3. **Partition** (:meth:`SimNetwork.cut` one direction, :meth:`SimNetwork.heal`):
   packets from one node to the other are dropped. A frame crossing a cut
   direction is held (TCP retransmits it) and delivered when the cut heals;
   a link that was not yet connected cannot connect while either direction
   is cut. A connected link whose connection is cut in either direction (its
   heartbeats or their answers are lost) dies ``heartbeat detection`` after
   the cut began - between ``heartbeat_timeout_s`` and that plus
   ``heartbeat_interval_s``, fixed per link - unless the cut healed first.
4. **Freeze** (:meth:`SimNetwork.freeze`, SIGSTOP; :meth:`SimNetwork.thaw`):
   the frozen node's kernel still accepts connections and buffers frames
   (they wait in its inbox until it runs again), but nothing answers:
   connected links toward it die by heartbeat as in 3, a link dialled to it
   cannot finish the ZMQ handshake and dies :data:`ZMQ_HANDSHAKE_S` after
   its TCP connection opened. When it thaws, its own connected links die if
   it was frozen for longer than the heartbeat timeout (the peers closed
   them: ``HEARTBEAT_TTL``).

A dead link's held frames are lost; frames already handed to the receiver
stay. A link its owner closes drops what it still holds (the last-words
linger is shorter than any fault). :meth:`SimNetwork.update` applies every
rule at the current time; the world calls it once per tick, before nodes step.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvpeer.testing.network import ControlNetwork, Endpoint
from kvpeer.transport.zmq_control import ZMQ_HANDSHAKE_MS

__all__ = ["ZMQ_HANDSHAKE_S", "Heartbeat", "SimControl", "SimLink", "SimNetwork"]

ZMQ_HANDSHAKE_S = ZMQ_HANDSHAKE_MS / 1000


@dataclass(frozen=True, slots=True)
class Heartbeat:
    interval: float
    timeout: float

    @property
    def longest_detection(self) -> float:
        return self.timeout + self.interval


class SimNetwork(ControlNetwork["SimControl"]):
    """Routes frames between attached nodes under the faults the world injects."""

    def __init__(
        self,
        clock: Callable[[], float],
        delay: Callable[[str, str], float],
        heartbeat: Heartbeat,
        rng: random.Random,
    ) -> None:
        super().__init__(clock)
        self._delay = delay
        self.heartbeat = heartbeat
        self._rng = rng
        self._cuts: dict[tuple[str, str], float] = {}  # (from, to) -> cut since
        self._frozen: dict[str, float] = {}  # node id -> frozen since
        self._arrivals: dict[tuple[str, str], float] = {}  # (from, to) -> last frame due

    # -- nodes -------------------------------------------------------------------------

    def _endpoint(self, node_id: str) -> SimControl:
        return SimControl(self, node_id)

    def attach(self, node_id: str) -> SimControl:
        control = super().attach(node_id)
        self._frozen.pop(node_id, None)
        return control

    def kill(self, node_id: str) -> None:
        super().kill(node_id)
        self._frozen.pop(node_id, None)

    def exists(self, node_id: str) -> bool:
        """Some incarnation ever attached (its host exists and refuses when it is down)."""
        return node_id in self._nodes

    def carries(self, a: str, b: str) -> bool:
        """Both up and running, nothing cut between them: bytes flow both ways."""
        return (
            self.is_up(a)
            and self.is_up(b)
            and a not in self._frozen
            and b not in self._frozen
            and (a, b) not in self._cuts
            and (b, a) not in self._cuts
        )

    # -- faults ------------------------------------------------------------------------

    def cut(self, sender: str, receiver: str) -> None:
        self._cuts.setdefault((sender, receiver), self._clock())

    def heal(self, sender: str, receiver: str) -> None:
        self._cuts.pop((sender, receiver), None)

    def is_cut(self, sender: str, receiver: str) -> bool:
        return (sender, receiver) in self._cuts

    def cuts(self) -> list[tuple[str, str]]:
        return list(self._cuts)

    def freeze(self, node_id: str) -> None:
        if self.is_up(node_id):
            self._frozen.setdefault(node_id, self._clock())

    def thaw(self, node_id: str) -> None:
        since = self._frozen.pop(node_id, None)
        control = self._nodes.get(node_id)
        if since is None or control is None or control.closed:
            return
        if self._clock() - since > self.heartbeat.timeout:
            for link in control.links:
                if link.connected_at is not None and link.connected_at <= since:
                    link.die("peer closed the connection (heartbeat TTL) while we were frozen")

    def last_arrival(self, sender: str, receiver: str) -> float | None:
        """When the last frame from ``sender`` reached ``receiver``'s inbox (frames a
        node sent before a fault can still arrive after it began: held by a cut,
        or sent as the fault struck)."""
        return self._arrivals.get((sender, receiver))

    def frozen_since(self, node_id: str) -> float | None:
        return self._frozen.get(node_id)

    def broken_since(self, a: str, b: str) -> float | None:
        """Since when the path between ``a`` and ``b`` (either direction) is cut."""
        cuts = self._cuts
        if not cuts:  # the common case, asked for every link and pair every tick
            return None
        there, back = cuts.get((a, b)), cuts.get((b, a))
        if there is None or back is None:
            return back if there is None else there
        return min(there, back)

    # -- time --------------------------------------------------------------------------

    def update(self) -> None:
        """Apply rules 1-4 now: connect, deliver held frames, let links die."""
        now = self._clock()
        for control in self._nodes.values():
            if control.closed:
                continue
            for link in control.links:
                if not (link.closed or link.dead):
                    self._update_link(link, now)

    def _update_link(self, link: SimLink, now: float) -> None:
        target = self._nodes.get(link.peer_id)
        if target is None:
            return  # no host: nothing ever answers
        cut = self.broken_since(link.sender, link.peer_id)
        if link.target is not target or target.closed:
            if cut is None:  # the reset (or refusal) reaches us
                refused = link.connected_at is None and link.tcp_at is None
                link.die("connection refused" if refused else "connection lost (the peer ended)")
                return
            if link.connected_at is None:
                return  # SYNs lost: keep trying
            if now >= self._broken_from(link, cut) + link.detection:
                link.die("heartbeat timeout")
            return
        frozen = self._frozen.get(link.peer_id)
        if link.connected_at is None:
            if cut is not None:
                return  # SYNs lost: keep trying
            if link.tcp_at is None:
                link.tcp_at = now
            if frozen is None:
                link.connected_at = now
                self._release(link, now)
            elif now >= link.tcp_at + ZMQ_HANDSHAKE_S:
                link.die("ZMQ handshake timed out (the peer does not answer)")
            return
        if cut is None and frozen is None:
            link.broken_from = None  # heartbeats got through at this update
        else:
            since = min(t for t in (cut, frozen) if t is not None)
            if now >= self._broken_from(link, since) + link.detection:
                link.die("heartbeat timeout")
                return
        if link.held and not self.is_cut(link.sender, link.peer_id):
            self._release(link, now)

    @staticmethod
    def _broken_from(link: SimLink, since: float) -> float:
        """Since when ``link``'s heartbeats are lost: a cut that heals and a new one
        (or a freeze) in the same tick leave no moment for a heartbeat to cross."""
        if link.broken_from is None:
            assert link.connected_at is not None
            link.broken_from = max(since, link.connected_at)
        return link.broken_from

    # -- frames ------------------------------------------------------------------------

    def _transmit(self, link: SimLink, frame: bytes) -> None:
        if (
            link.connected_at is None
            or link.held
            or self.is_cut(link.sender, link.peer_id)
            or link.target is None
        ):
            link.held.append(frame)  # retransmitted (or sent) once the path allows
            return
        self._deliver(link, frame, self._clock())

    def _release(self, link: SimLink, now: float) -> None:
        while link.held:
            self._deliver(link, link.held.popleft(), now)

    def _deliver(self, link: SimLink, frame: bytes, now: float) -> None:
        target = link.target
        if target is None or target.closed:
            self.frames_dropped += 1
            return
        # A link never reorders, nor does a next link overtake an earlier one's frames.
        due = now + self._delay(link.sender, link.peer_id)
        due = max(due, target.last_due.get(link.sender, 0.0))
        target.last_due[link.sender] = due
        self._arrivals[(link.sender, link.peer_id)] = due
        self._enqueue(target, due, link.sender, frame)
        self.frames_sent += 1

    def _refuse(self, sender: str, peer_id: str, frame: bytes) -> None:
        """An answer on the peer's own connection: lost if that direction is cut."""
        target = self._nodes.get(peer_id)
        if target is None or target.closed or self.is_cut(sender, peer_id):
            return
        self._arrivals[(sender, peer_id)] = self._clock()
        self._enqueue(target, self._clock(), sender, frame)

    def _dial(self, control: SimControl, peer_id: str) -> SimLink:
        target = self._nodes.get(peer_id)
        detection = self.heartbeat.timeout + self._rng.random() * self.heartbeat.interval
        link = SimLink(self, control, peer_id, target, detection)
        if target is None or not target.closed:
            self._update_link(link, self._clock())
        # else: refused; ZMQ reports it a moment later (the next update)
        return link


class SimLink:
    """Our outbound link (a DEALER) to one peer."""

    def __init__(
        self,
        network: SimNetwork,
        sender: SimControl,
        peer_id: str,
        target: SimControl | None,
        detection: float,
    ) -> None:
        self._network = network
        self._sender = sender
        self.sender = sender.local_id
        self._peer_id = peer_id
        self.target = target  # the incarnation dialled (None: no such host)
        self.detection = detection  # heartbeat: cut -> dead
        self.tcp_at: float | None = None
        self.connected_at: float | None = None
        self.broken_from: float | None = None  # heartbeats lost since (connected links)
        self.held: deque[bytes] = deque()
        self.closed = False
        self.dead: str | None = None
        self.unread: str | None = None  # a simulated peer always reads

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def alive(self) -> bool:
        return not self.closed and self.dead is None and not self._sender.closed

    def transmit(self, frame: bytes) -> bool:
        if not self.alive:
            return False
        self._network._transmit(self, bytes(frame))
        return True

    def die(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            self._network.frames_dropped += len(self.held)
            self.held.clear()

    def close(self, *, park: bool = True) -> None:
        self.closed = True  # a simulated link keeps no connection to park
        self._network.frames_dropped += len(self.held)
        self.held.clear()


class SimControl(Endpoint[SimLink]):
    """One node incarnation's endpoint on a :class:`SimNetwork`."""

    def __init__(self, network: SimNetwork, node_id: str) -> None:
        super().__init__(network._clock, node_id)
        self._network = network
        #: per sender: when its latest frame to this incarnation arrives (all its links)
        self.last_due: dict[str, float] = {}

    def connect(self, peer_id: str) -> SimLink:
        if self.closed:
            raise RuntimeError(f"{self._local_id}: endpoint closed")
        link = self._network._dial(self, peer_id)
        self.links = [x for x in self.links if not (x.closed or x.dead)]
        self.links.append(link)
        return link

    def refuse(self, peer_id: str, frame: bytes) -> None:
        self._network._refuse(self._local_id, peer_id, frame)
