"""An in-memory control network for tiers: ordered, optionally delayed frames.

Each node attaches with its peer id and gets a :class:`MemoryControl`
(the :class:`~kvpeer.transport.base.ControlTransport` contract). Frames on a
link keep their order; ``delay`` (a callable of sender and receiver) holds
them back in simulated time. ``kill`` makes a node vanish: links toward it
die (as heartbeats would notice) and its frames are dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvpeer.errors import PeerLost
from kvpeer.transport.base import InboundFrame

__all__ = ["MemoryControl", "MemoryControlLink", "MemoryNetwork"]


class MemoryNetwork:
    """Routes frames between attached nodes using a shared clock."""

    def __init__(
        self,
        clock: Callable[[], float],
        delay: Callable[[str, str], float] | None = None,
    ) -> None:
        self._clock = clock
        self._delay = delay
        self._nodes: dict[str, MemoryControl] = {}
        self._seq = 0
        self.frames_sent = 0
        self.frames_dropped = 0

    def attach(self, node_id: str) -> MemoryControl:
        old = self._nodes.get(node_id)
        if old is not None and not old.closed:
            raise ValueError(f"{node_id!r} is already attached")
        control = MemoryControl(self, node_id)
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

    def _send(self, link: MemoryControlLink, frame: bytes) -> None:
        target = self._nodes.get(link.peer_id)
        if target is None or target.closed:
            self.frames_dropped += 1  # nobody listens: like a silent host
            return
        now = self._clock()
        due = now + (self._delay(link.sender, link.peer_id) if self._delay else 0.0)
        due = max(due, link.last_due)  # a link never reorders
        link.last_due = due
        self._seq += 1
        target.inbox.append((due, self._seq, InboundFrame(link.sender, frame)))
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


class MemoryControl:
    """One node's endpoint on a :class:`MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, node_id: str) -> None:
        self._network = network
        self._local_id = node_id
        self.inbox: deque[tuple[float, int, InboundFrame]] = deque()
        self.closed = False
        self.links: list[MemoryControlLink] = []

    @property
    def local_id(self) -> str:
        return self._local_id

    def connect(self, peer_id: str) -> MemoryControlLink:
        if self.closed:
            raise PeerLost(f"{self._local_id}: endpoint closed")
        link = MemoryControlLink(self._network, self, peer_id)
        self.links = [x for x in self.links if not x.closed]
        self.links.append(link)
        return link

    def receive(self) -> list[InboundFrame]:
        if self.closed:
            return []
        now = self._network._clock()
        ready: list[tuple[float, int, InboundFrame]] = []
        waiting: deque[tuple[float, int, InboundFrame]] = deque()
        for item in self.inbox:
            (ready if item[0] <= now else waiting).append(item)
        self.inbox = waiting
        ready.sort(key=lambda item: (item[0], item[1]))
        return [frame for _, _, frame in ready]

    def flush(self) -> None:
        """Frames are handed to the network at transmit time: nothing to do."""

    def next_deadline(self) -> float | None:
        """No timers of its own."""
        return None

    def refuse(self, peer_id: str, frame: bytes) -> None:
        """Deliver ``frame`` straight back to ``peer_id`` (its own connection)."""
        if self.closed:
            return
        target = self._network._nodes.get(peer_id)
        if target is not None and not target.closed:
            now = self._network._clock()
            self._network._seq += 1
            target.inbox.append((now, self._network._seq, InboundFrame(self._local_id, frame)))

    def next_due(self) -> float | None:
        return min((item[0] for item in self.inbox), default=None)

    def close(self) -> None:
        self.closed = True
        self.inbox.clear()
        for link in self.links:
            link.close()
