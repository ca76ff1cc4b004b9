"""A fake data plane whose transfers a test completes, delays or fails.

Every node gets a :class:`FakeDataPlane` over its own :class:`Region`; the
planes of one test share a :class:`Fabric` that knows which node owns which
region. A write is pending until the test (or ``auto_complete``) finishes
it; completing copies the bytes, so byte-exact checks are real. Writes that
land in slots the consumer has not opened for the peer are recorded as
:attr:`FakeDataPlane.violations` (the consumer's side of the contract).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvpeer.errors import DataPlaneError
from kvpeer.protocol import Connect, TransportChoice
from kvpeer.session.ports import TransferEvent
from kvpeer.transport.base import LocalRegion

__all__ = ["Fabric", "FakeDataPlane", "PendingWrite", "Region"]


class Region:
    """A primary region: ``num_blocks`` rows of ``block_len`` bytes (own or given memory)."""

    def __init__(
        self, num_blocks: int, block_len: int, memory: memoryview | bytearray | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.block_len = block_len
        if memory is None:
            memory = bytearray(num_blocks * block_len)
        elif len(memory) != num_blocks * block_len:
            raise ValueError(f"memory of {len(memory)} bytes, need {num_blocks} x {block_len}")
        self.memory: memoryview | bytearray = memory

    def block(self, slot: int) -> bytes:
        self._check(slot)
        start = slot * self.block_len
        return bytes(self.memory[start : start + self.block_len])

    def write(self, slot: int, data: bytes) -> None:
        self._check(slot)
        if len(data) != self.block_len:
            raise ValueError(f"block of {len(data)} bytes, region rows are {self.block_len}")
        start = slot * self.block_len
        self.memory[start : start + self.block_len] = data

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"slot {slot} outside 0..{self.num_blocks - 1}")


class Fabric:
    """Which node id owns which fake data plane."""

    def __init__(self) -> None:
        self.planes: dict[str, FakeDataPlane] = {}
        self.transfer_ids = itertools.count(1)


@dataclass(slots=True)
class PendingWrite:
    transfer_id: int
    peer_id: str
    local_slots: tuple[int, ...]
    remote_slots: tuple[int, ...]
    busy: bool = False  # a wait-mode cancel cannot release it


@dataclass(slots=True)
class _Peer:
    region: Region
    plane: FakeDataPlane
    choice: TransportChoice | None = None
    acknowledged: TransportChoice | None = None


class FakeDataPlane:
    """Implements :class:`~kvpeer.session.ports.DataPlane` in memory."""

    def __init__(
        self,
        fabric: Fabric,
        node_id: str,
        region: Region,
        *,
        auto_complete: bool = False,
        choice: TransportChoice | None = None,
        enforce_windows: bool = False,
    ) -> None:
        """``enforce_windows``: a write into a slot the consumer has not opened for us
        fails and lands nowhere (as with ``tcp``); otherwise it lands and is recorded
        in :attr:`violations` (as with the one-sided ``shm`` and ``nixl``)."""
        self.fabric = fabric
        self.node_id = node_id
        self.region = region
        self.auto_complete = auto_complete
        self.enforce_windows = enforce_windows
        self.refused: list[int] = []  # transfers refused by an enforced window
        self.choice = choice
        self.refuse_peers: dict[str, str] = {}  # peer id -> reason register_peer raises
        self.fail_next_writes = 0
        self.pending: dict[int, PendingWrite] = {}
        self.violations: list[str] = []
        self.cancelled: list[int] = []
        self.writes_started = 0
        self.closed = False
        self._peers: dict[str, _Peer] = {}
        self._open: dict[str, dict[int, int]] = {}  # peer id -> slots opened for its writes
        self._events: dict[str, list[TransferEvent]] = {}
        self.granted: set[str] = set()  # peer ids granted and not revoked
        #: the node's held copies (kvpeer.node.held), read as local slots num_blocks..
        self.held: memoryview | None = None
        fabric.planes[node_id] = self

    # -- DataPlane --------------------------------------------------------------

    def register_peer(self, peer_id: str, hello: Connect) -> TransportChoice | None:
        if peer_id in self.refuse_peers:
            raise DataPlaneError(self.refuse_peers[peer_id])
        plane = self.fabric.planes.get(hello.peer_id)
        if plane is None:
            raise DataPlaneError(f"no region known for {hello.peer_id!r}")
        if hello.num_blocks != plane.region.num_blocks or hello.block_len != plane.region.block_len:
            raise DataPlaneError(f"{hello.peer_id!r} advertised a region it does not have")
        self._peers[peer_id] = _Peer(plane.region, plane, self.choice)
        return self.choice

    def peer_acknowledged(self, peer_id: str, choice: TransportChoice | None) -> None:
        peer = self._peers.get(peer_id)
        if peer is not None:
            peer.acknowledged = choice

    def unregister_peer(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)
        for transfer_id in [t for t, w in self.pending.items() if w.peer_id == peer_id]:
            del self.pending[transfer_id]
        self._events.pop(peer_id, None)

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        if peer_id not in self._peers:
            raise DataPlaneError(f"peer {peer_id!r} is not registered")
        if self.fail_next_writes > 0:
            self.fail_next_writes -= 1
            raise DataPlaneError("injected: write could not start")
        if len(local_slots) != len(remote_slots):
            raise DataPlaneError("local and remote slot counts differ")
        target = self._peers[peer_id].region
        local_limit = self.region.num_blocks + self._held_rows()
        for slot in local_slots:
            if not 0 <= slot < local_limit:
                raise DataPlaneError(f"local slot {slot} outside our {local_limit}")
        for slot in remote_slots:
            if not 0 <= slot < target.num_blocks:
                raise DataPlaneError(
                    f"remote slot {slot} outside {peer_id!r}'s {target.num_blocks}"
                )
        transfer_id = next(self.fabric.transfer_ids)
        self.pending[transfer_id] = PendingWrite(
            transfer_id, peer_id, tuple(local_slots), tuple(remote_slots)
        )
        self.writes_started += 1
        return transfer_id

    def poll(self, peer_id: str) -> list[TransferEvent]:
        if self.auto_complete and self.pending:
            for transfer_id in [t for t, w in self.pending.items() if w.peer_id == peer_id]:
                if not self.pending[transfer_id].busy:
                    self.complete(transfer_id)
        return self._events.pop(peer_id, [])

    def cancel(self, transfer_ids: Sequence[int], *, wait: bool) -> list[int]:
        still: list[int] = []
        for transfer_id in transfer_ids:
            write = self.pending.get(transfer_id)
            if write is None:
                continue
            if wait and write.busy:
                still.append(transfer_id)
                continue
            del self.pending[transfer_id]
            self.cancelled.append(transfer_id)
        return still

    def expect_writes(self, peer_id: str, slots: Sequence[int]) -> None:
        opened = self._open.setdefault(peer_id, {})
        for slot in slots:
            opened[slot] = opened.get(slot, 0) + 1

    def revoke_writes(self, peer_id: str, slots: Sequence[int]) -> None:
        opened = self._open.get(peer_id, {})
        for slot in slots:
            count = opened.get(slot, 0) - 1
            if count > 0:
                opened[slot] = count
            else:
                opened.pop(slot, None)
        if not opened:
            self._open.pop(peer_id, None)

    def describe(self) -> LocalRegion:
        return LocalRegion(num_blocks=self.region.num_blocks, block_len=self.region.block_len)

    def grant(self, peer_id: str) -> None:
        self.granted.add(peer_id)

    def revoke(self, peer_id: str) -> None:
        self.granted.discard(peer_id)

    def prepare_peer(self, peer_id: str, hello: Connect) -> bool:
        return True  # registering in memory is instant: never off the lock

    def preparing(self, peer_id: str) -> bool:
        return False

    def settle_peer(self, peer_id: str) -> None:
        pass  # nothing is ever prepared

    def close(self) -> None:
        self._peers.clear()
        self.pending.clear()
        self._events.clear()
        self._open.clear()
        self.closed = True

    # -- test controls ----------------------------------------------------------

    def complete(self, transfer_id: int) -> None:
        """Finish a pending write: copy its blocks and report success."""
        write = self.pending.pop(transfer_id)
        peer = self._peers[write.peer_id]
        target = peer.plane
        opened = target.open_slots_for(self.node_id)
        if self.enforce_windows and not set(write.remote_slots) <= opened:
            self.refused.append(transfer_id)
            self._events.setdefault(write.peer_id, []).append(
                TransferEvent(transfer_id, False, "refused: slot not open for us")
            )
            return
        for local, remote in zip(write.local_slots, write.remote_slots, strict=True):
            if remote not in opened:
                self.violations.append(
                    f"write {transfer_id} into {target.node_id} slot {remote}, not opened for us"
                )
            peer.region.write(remote, self.read_block(local))
        self._events.setdefault(write.peer_id, []).append(TransferEvent(transfer_id, True))

    def _held_rows(self) -> int:
        return 0 if self.held is None else self.held.nbytes // self.region.block_len

    def read_block(self, slot: int) -> bytes:
        """The block a write reads from local ``slot`` as it completes: a primary row,
        or a row of :attr:`held` (``num_blocks`` ..)."""
        if slot < self.region.num_blocks or self.held is None:
            return self.region.block(slot)
        start = (slot - self.region.num_blocks) * self.region.block_len
        return bytes(self.held[start : start + self.region.block_len])

    def fail(self, transfer_id: int, reason: str = "injected failure") -> None:
        write = self.pending.pop(transfer_id)
        self._events.setdefault(write.peer_id, []).append(TransferEvent(transfer_id, False, reason))

    def complete_all(self) -> None:
        for transfer_id in list(self.pending):
            self.complete(transfer_id)

    def open_slots_for(self, writer_id: str) -> set[int]:
        """Our slots currently opened for writes by ``writer_id`` (peer ids are node ids)."""
        return set(self._open.get(writer_id, {}))

    def registered_peers(self) -> list[str]:
        return list(self._peers)
