"""An in-memory control network for tiers: ordered, optionally delayed frames.

Each node attaches with its peer id and gets a :class:`MemoryControl`
(the :class:`~kvpeer.transport.base.ControlTransport` contract). Frames on a
link keep their order; ``delay`` (a callable of sender and receiver) holds
them back in simulated time. ``kill`` makes a node vanish: links toward it
die (as heartbeats would notice) and its frames are dropped.

What every in-memory network shares is :class:`ControlNetwork` (nodes by id, the
latest incarnation of each; frames numbered and counted) and :class:`Endpoint` (one
incarnation's inbox of frames, each due at a time, and its links): the simulation's
network (``kvpeer.lab.sim.sim_network``) puts ZMQ-over-TCP faults on the same two.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from kvpeer.errors import PeerLost
from kvpeer.transport.base import InboundFrame

__all__ = ["ControlNetwork", "Endpoint", "MemoryControl", "MemoryControlLink", "MemoryNetwork"]


class _Link(Protocol):
    def close(self, *, park: bool = True) -> None: ...


LinkT = TypeVar("LinkT", bound=_Link)
EndpointT = TypeVar("EndpointT", bound="Endpoint[Any]")


class Endpoint(Generic[LinkT]):
    """One node incarnation's endpoint: the frames due in its inbox, its outbound links."""

    def __init__(self, clock: Callable[[], float], node_id: str) -> None:
        self._clock = clock
        self._local_id = node_id
        self.inbox: list[tuple[float, int, InboundFrame]] = []  # (due, seq, frame)
        self.closed = False
        self.links: list[LinkT] = []

    @property
    def local_id(self) -> str:
        return self._local_id

    def receive(self) -> list[InboundFrame]:
        """The frames due by now, by due time then sending order."""
        if self.closed or not self.inbox:
            return []
        now = self._clock()
        ready = [item for item in self.inbox if item[0] <= now]
        if not ready:
            return []
        self.inbox = [item for item in self.inbox if item[0] > now]
        ready.sort(key=lambda item: (item[0], item[1]))
        return [frame for _, _, frame in ready]

    def flush(self) -> None:
        """Frames are handed to the network at transmit time: nothing to do."""

    def next_deadline(self) -> float | None:
        """No timers of its own."""
        return None

    def next_due(self) -> float | None:
        return min((item[0] for item in self.inbox), default=None)

    def close(self) -> None:
        self.closed = True
        self.inbox.clear()
        for link in self.links:
            link.close()


class ControlNetwork(ABC, Generic[EndpointT]):
    """Nodes by id (the latest incarnation of each); frames numbered and counted."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._nodes: dict[str, EndpointT] = {}
        self._seq = 0
        self.frames_sent = 0
        self.frames_dropped = 0

    @abstractmethod
    def _endpoint(self, node_id: str) -> EndpointT:
        """A new incarnation's endpoint (each network says which kind)."""

    def attach(self, node_id: str) -> EndpointT:
        old = self._nodes.get(node_id)
        if old is not None and not old.closed:
            raise ValueError(f"{node_id!r} is already attached")
        control = self._endpoint(node_id)
        self._nodes[node_id] = control
        return control

    def kill(self, node_id: str) -> None:
        """The node dies: its endpoint closes, links to it go dead."""
        control = self._nodes.get(node_id)
        if control is not None:
            control.close()

    def is_up(self, node_id: str) -> bool:
        control = self._nodes.get(node_id)
        return control is not None and not control.closed

    def _enqueue(self, target: EndpointT, due: float, sender: str, frame: bytes) -> None:
        """Put ``frame`` from ``sender`` in ``target``'s inbox, due at ``due``."""
        self._seq += 1
        target.inbox.append((due, self._seq, InboundFrame(sender, frame)))


class MemoryNetwork(ControlNetwork["MemoryControl"]):
    """Routes frames between attached nodes using a shared clock."""

    def __init__(
        self,
        clock: Callable[[], float],
        delay: Callable[[str, str], float] | None = None,
    ) -> None:
        super().__init__(clock)
        self._delay = delay

    def _endpoint(self, node_id: str) -> MemoryControl:
        return MemoryControl(self, node_id)

    def _send(self, link: MemoryControlLink, frame: bytes) -> None:
        target = self._nodes.get(link.peer_id)
        if target is None or target.closed:
            self.frames_dropped += 1  # nobody listens: like a silent host
            return
        now = self._clock()
        due = now + (self._delay(link.sender, link.peer_id) if self._delay else 0.0)
        due = max(due, link.last_due)  # a link never reorders
        link.last_due = due
        self._enqueue(target, due, link.sender, frame)
        self.frames_sent += 1


class MemoryControlLink:
    """Our outbound link to one peer."""

    def __init__(self, network: MemoryNetwork, sender: MemoryControl, peer_id: str) -> None:
        self._network = network
        self._sender = sender
        self._peer_incarnation = network._nodes.get(peer_id)
        self.sender = sender.local_id
        self._peer_id = peer_id
        self.last_due = 0.0
        self.closed = False
        self.refuse = False  # a peer that stopped reading
        self.unread: str | None = None  # set once ``refuse`` turned a frame away

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def alive(self) -> bool:
        if self.closed or self._sender.closed:
            return False
        current = self._network._nodes.get(self._peer_id)
        if self._peer_incarnation is None:
            # Dialled before the peer existed: alive until a peer shows up and dies.
            self._peer_incarnation = current
            return True
        return current is self._peer_incarnation and not current.closed

    def transmit(self, frame: bytes) -> bool:
        if not self.alive:
            return False
        if self.refuse:
            self.unread = "the peer does not read (the test's refuse)"
            return False
        self._network._send(self, frame)
        return True

    def close(self, *, park: bool = True) -> None:
        self.closed = True  # nothing to keep: a memory link has no connection


class MemoryControl(Endpoint[MemoryControlLink]):
    """One node's endpoint on a :class:`MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, node_id: str) -> None:
        super().__init__(network._clock, node_id)
        self._network = network

    def connect(self, peer_id: str) -> MemoryControlLink:
        if self.closed:
            raise PeerLost(f"{self._local_id}: endpoint closed")
        link = MemoryControlLink(self._network, self, peer_id)
        self.links = [x for x in self.links if not x.closed]
        self.links.append(link)
        return link

    def refuse(self, peer_id: str, frame: bytes) -> None:
        """Deliver ``frame`` straight back to ``peer_id`` (its own connection)."""
        if self.closed:
            return
        target = self._network._nodes.get(peer_id)
        if target is not None and not target.closed:
            self._network._enqueue(target, self._network._clock(), self._local_id, frame)
