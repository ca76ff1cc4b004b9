"""Held blocks in the simulation: a node's own copy, watched against what peers were promised.

Half of the worlds (drawn from a generator of their own, so a world without held
blocks is the very world it was before they were modelled) give some of their
nodes a :class:`~kvpeer.node.held.HeldBlocks` of a few rows
(:class:`HeldProfile`): few enough that within a seed blocks are released to make
room, rows are pinned while blocks are stored, and every row is pinned as a block
comes, which is then not kept. The node's fake data plane reads local slots
``num_blocks ..`` from that copy, as the ``shm`` plane does, and only toward the
peers whose planes read held rows (the others stand for sessions on ``tcp`` or
``nixl``, which are never given a held slot).

:class:`WatchedHeld` learns, from the ``HeldSupply`` calls alone, what each peer was
promised: every held slot ``pin`` handed out, for which key, how many times, until
``unpin``. It reports, as they happen:

1. a slot handed out whose row does not hold exactly ``content(key)`` (held
   invariant 2: the copy of the primary slot the store job named);
2. a promised row overwritten: after every ``keep`` each pinned row still holds its
   key's bytes (invariants 1 and 3: a pinned row is never reused);
3. a write reading a held row nobody holds pinned any more (released, maybe reused),
   or toward a peer whose plane does not read held rows;
4. an ``unpin`` of a slot that was not promised.

What the checker adds (:mod:`kvpeer.lab.sim.checks`): held bytes within the bound,
the copy's pinned rows equal to the promised ones, none once the world is quiet.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvpeer.host import BlockPool
from kvpeer.lab.sim.timeouts import SimContext
from kvpeer.node.held import HeldBlocks
from kvpeer.types import Key

__all__ = ["HeldProfile", "WatchedHeld", "draw_held"]

HELD_WORLDS = 0.5  # share of the worlds with held blocks
# Rows of a copy: one or two (every row pinned by one served lookup, so a block
# stored meanwhile is not kept), or up to a long prompt's 16 blocks (served more).
FEW_ROWS, MAX_ROWS = (1, 2), 16
UNSERVED = 0.2  # a peer's plane does not read held rows (tcp, nixl)


@dataclass(frozen=True, slots=True)
class HeldProfile:
    """One node's held copy: ``held_bytes`` (rows of a block, and a remainder no row
    fits in) and the peers whose planes cannot read it."""

    held_bytes: int
    unserved: frozenset[str]

    def serves(self, peer_id: str) -> bool:
        return peer_id not in self.unserved


def draw_held(
    seed: int, peer_ids: Sequence[str], block_len: int, *, always: bool = False
) -> dict[str, HeldProfile]:
    """Which nodes of world ``seed`` hold blocks, and how many: peer id -> profile
    (empty for half of the worlds unless ``always``). A generator of its own, seeded
    by the world's seed, draws it, so the world's own draws are untouched."""
    rng = random.Random(f"held {seed}")
    if rng.random() >= HELD_WORLDS and not always:
        return {}
    chosen = rng.sample(list(peer_ids), rng.randint(1, len(peer_ids)))
    profiles = {}
    for peer_id in chosen:
        rows = rng.choice((*FEW_ROWS, rng.randint(FEW_ROWS[-1] + 1, MAX_ROWS)))
        unserved = frozenset(p for p in peer_ids if p != peer_id and rng.random() < UNSERVED)
        profiles[peer_id] = HeldProfile(rows * block_len + rng.randrange(block_len), unserved)
    return profiles


class WatchedHeld(HeldBlocks):
    """A node's held blocks, each promise to a peer checked (module docstring)."""

    def __init__(self, pool: BlockPool, profile: HeldProfile, ctx: SimContext, where: str) -> None:
        super().__init__(
            pool.view, pool.num_blocks, pool.block_len, profile.held_bytes, serves=profile.serves
        )
        self.serves_peer = profile.serves
        self.bound = profile.held_bytes
        self.block_len = pool.block_len
        self.ctx = ctx
        self.where = where
        self.promised: dict[int, int] = {}  # held slot -> pins handed out and not returned
        self.promised_key: dict[int, Key] = {}  # held slot -> the key it was last pinned for
        self.written = 0  # blocks written to peers from held rows

    @property
    def promised_pins(self) -> int:
        return sum(self.promised.values())

    def _row_holds(self, slot: int, key: Key) -> bool:
        start = (slot - self.first_slot) * self.block_len
        return self.view[start : start + self.block_len] == self.ctx.blocks.content(key)

    def pin(self, peer_id: str, keys: Sequence[Key]) -> list[int] | None:
        slots = super().pin(peer_id, keys)
        if slots is None:
            return None
        for key, slot in zip(keys, slots, strict=True):
            if self.promised.get(slot) and self.promised_key[slot] != key:
                self.ctx.violate(
                    self.where,
                    f"held slot {slot} pinned for key {key.hex()[:12]} while still pinned "
                    f"for key {self.promised_key[slot].hex()[:12]}",
                )
            elif not self._row_holds(slot, key):
                self.ctx.violate(
                    self.where,
                    f"held slot {slot} handed to {peer_id} for key {key.hex()[:12]} "
                    "does not hold that key's bytes",
                )
            self.promised[slot] = self.promised.get(slot, 0) + 1
            self.promised_key[slot] = key
        return slots

    def unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            count = self.promised.get(slot, 0)
            if count == 0:
                self.ctx.violate(self.where, f"held slot {slot} unpinned but not pinned")
            elif count == 1:
                del self.promised[slot]
            else:
                self.promised[slot] = count - 1
        super().unpin(slots)

    def keep(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        super().keep(keys, slots)
        for slot in self.promised:
            if not self._row_holds(slot, self.promised_key[slot]):
                self.ctx.violate(
                    self.where,
                    f"held slot {slot}, pinned for key {self.promised_key[slot].hex()[:12]}, "
                    "was overwritten while pinned (a pinned row reused)",
                )

    def read(self, slot: int) -> None:
        """A write is reading held ``slot`` (invariant 3)."""
        if slot not in self.promised:
            self.ctx.violate(
                self.where, f"a write read held slot {slot}, which nobody holds pinned (released)"
            )
        elif not self._row_holds(slot, self.promised_key[slot]):
            self.ctx.violate(
                self.where,
                f"a write read held slot {slot}, which no longer holds the bytes of key "
                f"{self.promised_key[slot].hex()[:12]} it was pinned for",
            )
        self.written += 1
