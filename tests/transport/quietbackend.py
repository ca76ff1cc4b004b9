"""The parts of a :class:`~kvpeer.transport.data.base.Backend` that a test fake does
not care about: it offers nothing, takes any peer, and has nothing to cancel."""

from __future__ import annotations

from collections.abc import Sequence

from kvpeer.protocol import Connect, TransportOffer
from kvpeer.transport.data.base import WriteWindow


class QuietBackend:
    """Subclass it and add ``name``, ``registers_slowly`` and what the test watches."""

    def offer(self) -> TransportOffer:
        return {}

    def agent_metadata(self) -> bytes:
        return b""

    def usable_with(self, offer: TransportOffer | None, hello: Connect) -> bool:
        return True

    def accept_writer(self, peer_id: str, params: TransportOffer, window: WriteWindow) -> None:
        pass

    def cancel(self, transfer_ids: Sequence[int], *, wait: bool) -> list[int]:
        return []

    def grant(self, peer_id: str) -> None:
        pass

    def revoke(self, peer_id: str) -> None:
        pass
