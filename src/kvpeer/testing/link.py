"""An in-memory control link: ordered frames between two endpoints."""

from __future__ import annotations

from collections import deque

from kvpeer.protocol import Codec, Message, UnknownMessage

__all__ = ["LinkEnd", "MemoryLink"]


class LinkEnd:
    """One direction's sender. ``transmit`` is what a session is given."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.in_transit: deque[bytes] = deque()
        self.log: list[bytes] = []  # every frame ever accepted, for assertions
        self.refuse = False  # the link refuses frames (down, or it gave the peer up)
        self.unread: str | None = None  # why it gave the peer up for not reading
        self.capacity: int | None = None

    def transmit(self, frame: bytes) -> bool:
        if self.refuse or (self.capacity is not None and len(self.in_transit) >= self.capacity):
            return False
        self.in_transit.append(bytes(frame))
        self.log.append(bytes(frame))
        return True

    def messages(self) -> list[Message | UnknownMessage]:
        """Every frame this end sent, decoded."""
        codec = Codec()
        return [codec.decode(frame) for frame in self.log]


class MemoryLink:
    """A pair of ordered one-way pipes, ``a_to_b`` and ``b_to_a``."""

    def __init__(self, a: str = "a", b: str = "b") -> None:
        self.a_to_b = LinkEnd(f"{a}->{b}")
        self.b_to_a = LinkEnd(f"{b}->{a}")
