"""What the session core needs from the outside world, as written contracts.

The core never does I/O itself: a :class:`DataPlane` moves bytes, a
:class:`Parent` answers lookups and pins slots, and an injected ``send``
callable carries encoded control frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpeer.protocol import Connect, TransportChoice
from kvpeer.types import Key, LookupResult, ServeRequest, StoreJob

__all__ = ["DataPlane", "EngineSteps", "HeldSupply", "Parent", "TransferEvent"]


@dataclass(frozen=True, slots=True)
class TransferEvent:
    """A transfer finished: every block written (``success``) or not."""

    transfer_id: int
    success: bool
    reason: str = ""


class DataPlane(Protocol):
    """Moves blocks from our primary region into a peer's (producer push).

    Contract:
    1. ``register_peer`` happens before any write to that peer and raises
       :class:`~kvpeer.errors.DataPlaneError` (or HandshakeRejected) if the
       peer's region cannot be used; it returns the plane it chose for writing
       to that peer, or None for the vLLM-compatible default (NIXL). Called again
       for the same peer (a session adopting the peer's next ``connect``), it
       replaces the registration.
    2. ``write_blocks`` never blocks; it returns a transfer id unique for the
       plane's lifetime or raises DataPlaneError if the transfer cannot start.
    3. ``poll(peer_id)`` returns each finished transfer of that peer exactly
       once; ``cancel`` releases transfers and returns the ids still touching
       memory (with ``wait=False`` it returns none: they are abandoned).
    4. ``expect_writes``/``revoke_writes`` open and close our own slots for
       writes by a peer (planes where the consumer takes part enforce them).
    """

    def register_peer(self, peer_id: str, hello: Connect) -> TransportChoice | None: ...

    def peer_acknowledged(self, peer_id: str, choice: TransportChoice | None) -> None: ...

    def unregister_peer(self, peer_id: str) -> None: ...

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int: ...

    def poll(self, peer_id: str) -> list[TransferEvent]: ...

    def cancel(self, transfer_ids: Sequence[int], *, wait: bool) -> list[int]: ...

    def expect_writes(self, peer_id: str, slots: Sequence[int]) -> None: ...

    def revoke_writes(self, peer_id: str, slots: Sequence[int]) -> None: ...


class Parent(Protocol):
    """The host's cache manager, valid only inside a serve window.

    ``create_store_job`` pins the slots of ``keys`` until the job's result is
    reported; ``on_request_finished`` is owed once per ``on_new_request``.
    """

    def on_new_request(self, request: ServeRequest) -> None: ...

    def lookup(self, key: Key, request: ServeRequest) -> LookupResult: ...

    def create_store_job(self, keys: Sequence[Key], request: ServeRequest) -> StoreJob: ...

    def on_request_finished(self, request: ServeRequest) -> None: ...


class HeldSupply(Protocol):
    """Blocks the node keeps its own copy of, servable without the parent.

    Contract: ``pin`` returns one local slot per key (in order) that the data plane
    reads that key's block from, or None when any key is not held or the peer's
    data plane cannot read held copies (then nothing was pinned). A pinned slot's
    bytes do not change until it is unpinned; ``unpin`` is owed once per slot
    ``pin`` returned. ``held_prefix`` is how many of ``keys``, from the first, ``pin``
    would pin for that peer now (0 when its data plane cannot read held copies); it
    pins nothing.
    """

    def pin(self, peer_id: str, keys: Sequence[Key]) -> list[int] | None: ...

    def held_prefix(self, peer_id: str, keys: Sequence[Key]) -> int: ...

    def unpin(self, slots: Sequence[int]) -> None: ...


class EngineSteps(Protocol):
    """When the node's engine is expected to have served a peer's lookup, if at all.

    Contract: ``answer_by(received_at)`` is the time by which a lookup that arrived at
    ``received_at`` and that held blocks could not answer is answered without the
    engine (its keys not yet resolved are misses, but for a prefix held blocks now
    hold), or None: it waits for the engine's serve window as before. It may move as
    the engine steps; it is never before ``received_at``.
    """

    def answer_by(self, received_at: float) -> float | None: ...
