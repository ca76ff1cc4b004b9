"""The index's per-block work in Python: the reference of ``kvpeer.router._intake``.

The index's state lives in a core (``router/indexcore.py``) built on one of two bases with
the same interface -- the C extension's when it is built, this module's otherwise (and
whenever ``PrefixIndex(native=False)``):

- ``Holders()``: invariant 7's masks of one medium, chain key -> bits of its holders;
- ``Core(refcounted, max_retired, unkeyed_prefix)``: the containers of every engine's
  blocks, owned, with the two loops every block goes through as its methods ``_stored``
  and ``_removed`` (their bodies: ``stored`` and ``removed`` below);
- ``chain(parent, tokens)`` / ``chain_keys(parent, tokens, width)``: chain keys.

Same arguments, same results, the same state left behind (dict order included) and the
same errors for what the index can pass; ``tests/router/test_index_native.py`` compares the
two on random event streams. The C side also refuses wrong types one by one (it must not
trust its caller's memory); here Python's own checks do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from itertools import islice
from typing import Final, Protocol, TypeVar

from kvpeer.router.kvevents import BlockHash

__all__ = [
    "CHAIN_BYTES", "Core", "Holders", "Masks", "chain", "chain_keys", "removed", "stored",
    "unkeyed_key",
]

CHAIN_BYTES: Final = 16
_K = TypeVar("_K")
_V = TypeVar("_V")


class Masks(Protocol):
    """Invariant 7's masks of one medium: chain key -> bits of the engines holding it."""

    def get(self, key: bytes, default: int = 0, /) -> int: ...
    def set_bit(self, key: bytes, index: int, /) -> None: ...
    def clear_bit(self, key: bytes, index: int, /) -> None: ...
    def items(self) -> list[tuple[bytes, int]]: ...
    def __len__(self) -> int: ...


class Holders:
    """``_intake.Holders`` in Python (there: an open-addressing table of 16-byte keys with
    their masks inline): the same methods and errors."""

    __slots__ = ("_masks",)

    def __init__(self) -> None:
        self._masks: dict[bytes, int] = {}

    def get(self, key: bytes, default: int = 0, /) -> int:
        return self._masks.get(_chained(key), default)

    def set_bit(self, key: bytes, index: int, /) -> None:
        key = _chained(key)
        self._masks[key] = self._masks.get(key, 0) | 1 << index

    def clear_bit(self, key: bytes, index: int, /) -> None:
        bits = self._masks[_chained(key)]
        if not bits >> index & 1:
            raise KeyError(key)  # invariant 7 broken
        bits ^= 1 << index
        if bits:
            self._masks[key] = bits
        else:
            del self._masks[key]

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._masks.items())

    def __len__(self) -> int:
        return len(self._masks)


class Core:
    """``_intake.Core`` in Python: every engine's containers (lists by the engine's bit
    position), the holder tables, the speculation masks, and the two loops over them."""

    __slots__ = (
        "_hashes", "_holders", "_max_retired", "_prefix", "_present", "_refcounted",
        "_retired", "_speculating", "_speculative",
    )

    def __init__(self, refcounted: frozenset[str], max_retired: int,
                 unkeyed_prefix: bytes) -> None:
        if type(refcounted) is not frozenset or type(max_retired) is not int or type(
            unkeyed_prefix
        ) is not bytes:
            raise TypeError("Core takes a frozenset, an int and bytes")
        if max_retired < 1 or not unkeyed_prefix:
            raise ValueError(f"Core needs max_retired >= 1 (not {max_retired}) and a "
                             "non-empty unkeyed_prefix")
        self._hashes: list[dict[BlockHash, bytes]] = []
        self._retired: list[dict[BlockHash, bytes]] = []
        self._present: list[dict[str, dict[bytes, int]]] = []
        self._speculative: list[dict[tuple[str, bytes], float]] = []
        self._holders: dict[str, Masks] = {}
        self._speculating: dict[tuple[str, bytes], int] = {}
        self._refcounted = refcounted
        self._prefix = unkeyed_prefix
        self._max_retired = max_retired

    def _stored(self, engine: int, medium: str, parent: bytes,
                block_hashes: tuple[BlockHash, ...], tokens: bytes, width: int
                ) -> tuple[int, bool]:
        """One store by ``engine`` in ``medium`` (stored in before) from ``parent``."""
        return stored(
            self._hashes[engine], self._retired[engine], self._present[engine][medium],
            self._holders[medium], self._speculative[engine], self._speculating, medium,
            1 << engine, engine, medium in self._refcounted, parent, block_hashes, tokens,
            width, self._prefix,
        )

    def _removed(self, engine: int, medium: str, block_hashes: tuple[BlockHash, ...]) -> int:
        """``engine`` removed ``block_hashes`` from ``medium`` (stored in before)."""
        media = self._present[engine]
        present = media[medium]
        others = [held for other, held in media.items() if other != medium]
        return removed(
            self._hashes[engine], self._retired[engine], present, self._holders[medium],
            others, engine, medium in self._refcounted, self._max_retired, block_hashes,
            self._prefix,
        )


def _chained(key: bytes) -> bytes:
    if type(key) is not bytes or len(key) != CHAIN_BYTES:
        raise TypeError(f"holder keys are {CHAIN_BYTES}-byte chain keys, not {key!r:.60}")
    return key


def stored(
    hashes: dict[BlockHash, bytes], retired: dict[BlockHash, bytes],
    present: dict[bytes, int], holders: Masks,
    speculative: dict[tuple[str, bytes], float],
    speculating: dict[tuple[str, bytes], int], medium: str, bit: int, index: int,
    refcounted: bool, parent: bytes, block_hashes: Sequence[BlockHash], tokens: bytes,
    width: int, prefix: bytes,
) -> tuple[int, bool]:
    """One store of ``block_hashes`` (each ``width`` bytes of ``tokens``) under ``parent``
    by the engine at ``index`` (mask ``bit``): maps each hash to its chain key, counts it
    present, marks the holder and ends a speculation it fulfils (its entry out of the
    engine's ``speculative``, its bit out of the index's ``speculating``). Returns (hashes
    remapped, whether the store was unkeyed). Keys that start with ``prefix`` are unkeyed
    (invariant 6) and in no mask."""
    unkeyed = parent.startswith(prefix)
    remapped = 0
    # Most blocks are known and keyed (the CPU tier's copies of the GPU's blocks):
    # each costs a lookup and two moves to the newest end.
    lookup, unretire, held = hashes.get, retired.pop, present.get
    for i, block_hash in enumerate(block_hashes):
        previous = lookup(block_hash)
        if previous is not None and not unkeyed and not previous.startswith(prefix):
            parent = previous  # a known hash names known content (invariant 8)
            del hashes[block_hash]
            hashes[block_hash] = parent
        else:
            live = previous is not None
            if previous is None:
                previous = unretire(block_hash, None)  # held again: live (invariant 2)
            if previous is None:
                if unkeyed:
                    parent = unkeyed_key(prefix, block_hash)  # a salted block's child
                else:
                    parent = chain(parent, tokens[i * width : (i + 1) * width])
            elif unkeyed or previous.startswith(prefix):
                parent = unkeyed_key(prefix, block_hash)  # a salted block or its child
                remapped += previous != parent
                unkeyed = True
            else:
                parent = previous
            if live:
                del hashes[block_hash]
            hashes[block_hash] = parent
        count = held(parent)
        if count is None:
            present[parent] = 1
            if not unkeyed:  # an unkeyed key is in no mask (invariant 7)
                holders.set_bit(parent, index)
        else:
            del present[parent]
            present[parent] = count + 1 if refcounted else count  # a set's stays 1
        if speculative and speculative.pop((medium, parent), None) is not None:
            drop_bit(speculating, (medium, parent), bit)
    return remapped, unkeyed


def removed(
    hashes: dict[BlockHash, bytes], retired: dict[BlockHash, bytes],
    present: dict[bytes, int], holders: Masks, others: list[dict[bytes, int]], index: int,
    refcounted: bool, max_retired: int, block_hashes: Sequence[BlockHash], prefix: bytes,
) -> int:
    """The engine at ``index`` removed ``block_hashes`` from the medium of ``present``
    (``others``: what it holds in its other media). Returns how many it did not hold."""
    lookup, held_count = hashes.get, present.get
    unknown = 0
    for block_hash in block_hashes:
        key = lookup(block_hash)
        if key is None:
            unknown += 1
            continue
        count = held_count(key)
        if count is None:
            unknown += 1
            continue
        if refcounted and count > 1:
            present[key] = count - 1
            continue
        del present[key]
        drop_holder(holders, key, index, prefix)
        for held in others:
            if key in held:
                break
        else:  # the block left every medium: retire its mapping (invariant 2)
            del hashes[block_hash]
            retired[block_hash] = key  # never there while live: goes in as newest
            if len(retired) > max_retired:
                oldest_out(retired, max_retired)
    return unknown


def unkeyed_key(prefix: bytes, block_hash: BlockHash) -> bytes:
    """The key of a block under extra keys: its engine hash behind ``prefix``, which no
    chain key starts with, so no prompt resolves to it (invariant 6)."""
    raw = block_hash if isinstance(block_hash, bytes) else b"%d" % block_hash
    return prefix + raw


def drop_bit(masks: dict[_K, int], key: _K, bit: int) -> None:
    """Clear ``bit`` (set: invariant 7) in ``masks[key]``; no bit left, no entry."""
    bits = masks[key] ^ bit
    if bits:
        masks[key] = bits
    else:
        del masks[key]


def drop_holder(holders: Masks, key: bytes, index: int, prefix: bytes) -> None:
    """Engine ``index`` no longer holds ``key`` (an unkeyed key is in no mask)."""
    if not key.startswith(prefix):
        holders.clear_bit(key, index)


def oldest_out(entries: dict[_K, _V], limit: int) -> list[_K]:
    """Past ``limit``, the oldest entries out down to ``limit - limit // 8``: the keys
    gone. A plain dict finds its oldest by a walk from the front past the slots of
    entries deleted before, so they go an eighth of the bound at a time (invariant 2)."""
    if len(entries) <= limit:
        return []
    gone = list(islice(entries, len(entries) - (limit - limit // 8)))
    for key in gone:
        del entries[key]
    return gone


def chain(parent: bytes, tokens: bytes) -> bytes:
    """The chain key of ``tokens`` after ``parent``: SHA-256, its first 16 bytes."""
    return hashlib.sha256(parent + tokens).digest()[:CHAIN_BYTES]


def chain_keys(parent: bytes, tokens: bytes, width: int) -> tuple[bytes, ...]:
    """The chain keys of ``tokens`` (packed ``uint32``), ``width`` bytes a block (a
    shorter last piece too), each the next one's parent, from ``parent``."""
    keys = []
    for start in range(0, len(tokens), width):
        parent = chain(parent, tokens[start : start + width])
        keys.append(parent)
    return tuple(keys)
