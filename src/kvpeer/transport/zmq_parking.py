"""Parked control links: a closed link's connection kept for the peer's next link.

:class:`kvpeer.transport.zmq_control.ZmqControl`'s rule 6: a peer's ROUTER never
reads a second connection under our identity while it still holds the first
(``ROUTER_HANDOVER`` off, here and in vLLM), and lets go of the first only some
commands after that connection closed. So a link that closes with its
connection up (or coming up) is parked, and the next link to that peer takes
the connection over. :class:`Parking` holds the parked links, one per peer,
oldest first, and says which to let go: a link parked ``park_s`` ago, the older
link of a peer whose newer one is parked, the oldest when more than
``max_parked`` are. The control does the socket work and lets them go
(``drop``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpeer.transport.zmq_link import ZmqLink

__all__ = ["MAX_PARKED_LINKS", "PARK_S", "Parking"]

#: Closed links whose connection is kept for the peer's next link, and for how long.
MAX_PARKED_LINKS = 256
PARK_S = 10.0


class Parking:
    """The parked links by peer, in the order they were parked."""

    def __init__(
        self,
        max_parked: int,
        park_s: float,
        clock: Callable[[], float],
        drop: Callable[[ZmqLink], None],
    ) -> None:
        """``drop`` lets a link go (closes its sockets, forgets it and calls
        :meth:`forget`)."""
        self._max_parked = max_parked
        self._park_s = park_s
        self._clock = clock
        self._drop = drop
        self._parked: dict[str, ZmqLink] = {}  # peer id -> its parked link

    def __len__(self) -> int:
        return len(self._parked)

    def get(self, peer_id: str) -> ZmqLink | None:
        return self._parked.get(peer_id)

    def park(self, link: ZmqLink) -> bool:
        """Keep closed ``link``'s connection for the peer's next link, if it is up."""
        if link.socket is None or link.dead_reason is not None or not link.parkable:
            return False  # no connection, a lost one, or the owner's word
        if self._max_parked <= 0:
            return False
        if link.loss() is not None:
            return False  # lost (one still connecting is parked: its frames go first)
        previous = self._parked.pop(link.peer_id, None)
        if previous is not None:
            self._drop(previous)
        while len(self._parked) >= self._max_parked:
            self._drop(next(iter(self._parked.values())))  # the oldest
        link.parked, link.parked_until = True, self._clock() + self._park_s
        self._parked[link.peer_id] = link
        return True

    def expire(self) -> None:
        """Let go of the links parked ``park_s`` ago or more."""
        if not self._parked:
            return
        now = self._clock()
        while self._parked and next(iter(self._parked.values())).parked_until <= now:
            self._drop(next(iter(self._parked.values())))  # parked in this order

    def next_deadline(self) -> float | None:
        """When the oldest parked link is due to be let go."""
        return next(iter(self._parked.values())).parked_until if self._parked else None

    def forget(self, link: ZmqLink) -> None:
        """``link`` was let go (or handed over): no longer parked."""
        if self._parked.get(link.peer_id) is link:
            del self._parked[link.peer_id]

    def clear(self) -> None:
        self._parked.clear()
