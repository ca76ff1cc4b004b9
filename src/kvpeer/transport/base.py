"""Contracts between a node and its transports.

Control (docs/protocol.md section 1): a node receives every peer's frames on one
inbound endpoint, tagged with the sender's peer id, and sends to each peer on
an outbound :class:`ControlLink`. Frames are delivered in order per peer;
``transmit`` never blocks (False = the peer cannot take it, the session
ends); ``alive`` turns False when the transport decides the peer is gone
(heartbeat, disconnect). The contract in full (one conformance suite,
:mod:`kvpeer.testing.control_conformance`, runs it on every implementation):

1. ``connect`` on an open endpoint never raises: an unreachable or malformed peer id
   gives a link that is dead at once or dies when the transport learns so.
2. ``transmit`` never raises; a closed or dead link says False. Frames a link took
   before ``close`` still go out (a goodbye: connect, transmit, close).
3. Frames arrive in order per link, tagged with the sender's ``local_id``; a
   ``refuse`` arrives at the peer tagged with ours, and to an unknown peer is dropped.
4. A link to an endpoint that closed dies.
5. After ``close`` (idempotent) an endpoint is inert: its links are dead,
   ``receive`` returns nothing, ``flush`` and ``refuse`` do nothing, and
   ``connect`` raises :class:`~kvpeer.errors.PeerLost`.
6. A link gives its peer up when what it holds for a peer that does not read
   outgrows its bounds; ``transmit`` then says False and ``unread`` says why
   (for a link that is dead or closed for any other reason, ``unread`` is None):
   the session ends ``over_budget``, not ``unreachable``.

Data planes are the session core's
:class:`~kvpeer.session.ports.DataPlane` plus what a node needs to describe
its own region in ``connect`` and to shut down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvpeer.protocol import Connect, TransportOffer
from kvpeer.session.ports import DataPlane

__all__ = ["ControlLink", "ControlTransport", "InboundFrame", "LocalRegion", "NodeDataPlane"]


@dataclass(frozen=True, slots=True)
class InboundFrame:
    """A frame from ``peer_id`` (the identity it claims); ``source`` is the IP address
    the connection really comes from, when the transport knows it."""

    peer_id: str
    frame: bytes
    source: str | None = None


class ControlLink(Protocol):
    """Our outbound channel to one peer."""

    @property
    def peer_id(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    def transmit(self, frame: bytes) -> bool: ...

    @property
    def unread(self) -> str | None:
        """Why the link gave its peer up for not reading what we sent (rule 6), or None."""
        ...

    def close(self, *, park: bool = True) -> None:
        """Close the link (frames it queued still go out). ``park``: its connection may
        be kept for our next link to the peer (a transport whose peers read a new
        connection late, ZMQ's); off when the peer fell silent, so nothing is kept
        toward a peer that may be gone."""
        ...


class ControlTransport(Protocol):
    """One node's control endpoint."""

    @property
    def local_id(self) -> str: ...

    def connect(self, peer_id: str) -> ControlLink: ...

    def receive(self) -> list[InboundFrame]: ...

    def flush(self) -> None:
        """Send what links queued, now (the owner calls it at the end of a tick)."""
        ...

    def refuse(self, peer_id: str, frame: bytes) -> None:
        """Best effort: answer ``peer_id`` on the connection it came in on, without
        dialling it (a refused identity must not make us connect anywhere)."""
        ...

    def next_deadline(self) -> float | None:
        """When :meth:`receive` is next due for a timer of the transport's own (in
        the owner's clock), or None."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LocalRegion:
    """What our ``connect`` says about our primary region and data planes."""

    num_blocks: int
    block_len: int
    base_addr: int = 0
    agent_metadata: bytes = b""
    offers: dict[str, TransportOffer] = field(default_factory=dict)


class NodeDataPlane(DataPlane, Protocol):
    def describe(self) -> LocalRegion: ...

    def grant(self, peer_id: str) -> None:
        """We open a session toward ``peer_id``: it may use what our offers hand out
        on proof (called before our ``connect`` goes to it; never raises)."""
        ...

    def revoke(self, peer_id: str) -> None:
        """The session with ``peer_id`` ended: undo :meth:`grant`."""
        ...

    def prepare_peer(self, peer_id: str, hello: Connect) -> bool:
        """Before a session registers ``hello``: True if it may now; False if the
        registration runs off the node's lock - route the peer's frames again once
        :meth:`preparing` is False, then call :meth:`settle_peer`."""
        ...

    def preparing(self, peer_id: str) -> bool:
        """Whether a registration :meth:`prepare_peer` started still runs."""
        ...

    def settle_peer(self, peer_id: str) -> None:
        """After the frames held for a preparation were routed: forget what was
        prepared and not registered by a session."""
        ...

    def close(self) -> None: ...
