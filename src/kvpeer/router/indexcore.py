"""The index's state as one object behind six methods, over a native or a Python base.

A core owns what every engine holds (``PrefixIndex`` keeps names, block size, learned bits
and counters; it never touches a container): per engine, by its bit position, the hash
mappings and the retired ones, the blocks present per medium, the speculative entries;
per medium the holder masks (invariant 7 of ``router/index.py``); the fleet's speculation
masks. Its methods:

- ``add_engine()``: a new engine's empty containers, and its bit position;
- ``apply(engine, event, width)``: one store, salted store, removal or clear, with the
  counts it gives;
- ``speculate(engine, keys, medium, now, expiry)``: the router just sent these blocks;
- ``prefixes(keys, medium, alive, now)``: the longest held prefix of every engine whose
  bit is in ``alive`` (one engine's, or the fleet's), in one walk;
- ``forget(engine, restarted)``: drop what an engine holds (and, restarted, its mappings);
- ``statistics(engine, now)``: what it holds, for ``/metrics``.

They are written once, here. The containers and the two loops every block goes through
(``_stored``, ``_removed``) come from the base: ``kvpeer.router._intake.Core`` (C) when
that extension is built, else ``kvpeer.router.indexloops.Core``, its reference with the
same interface; ``tests/router/test_index_native.py`` runs both on random streams and
compares every container, order included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Final

from kvpeer.router import indexloops
from kvpeer.router.indexloops import Masks, drop_bit, drop_holder, oldest_out, unkeyed_key
from kvpeer.router.kvevents import (
    AllCleared,
    BlockHash,
    BlocksRemoved,
    BlocksStored,
    BlocksUnkeyable,
)

__all__ = ["CoreMethods", "Counts", "IndexEvent", "new_core"]

Counts = tuple[tuple[str, int], ...]  # (counter, by how much), for the index's counters
IndexEvent = BlocksStored | BlocksUnkeyable | BlocksRemoved | AllCleared
_NONE: Final[Counts] = ()
_NO_HOLDERS: Final = indexloops.Holders()  # read only: a medium nobody stored in


class CoreMethods:
    """The core's methods over the containers its base owns (see the module docstring).

    No ``__slots__``: the base's layout is the only one a class can have, so the three
    settings ``new_core`` gives live in the instance's dict."""

    # The base's containers, lists by engine bit position (indexloops.Core documents them).
    _hashes: list[dict[BlockHash, bytes]]
    _retired: list[dict[BlockHash, bytes]]
    _present: list[dict[str, dict[bytes, int]]]
    _speculative: list[dict[tuple[str, bytes], float]]
    _holders: dict[str, Masks]
    _speculating: dict[tuple[str, bytes], int]
    _refcounted: frozenset[str]
    _prefix: bytes
    # Set by new_core.
    _root: bytes
    _max_blocks: int
    _max_speculative: int
    _new_holders: ClassVar[type[Masks]]

    # The base's two loops: (engine, medium, parent, block hashes, tokens, width) ->
    # (hash_remapped, unkeyed), and (engine, medium, block hashes) -> blocks unknown.
    _stored: Callable[[int, str, bytes, tuple[BlockHash, ...], bytes, int], tuple[int, bool]]
    _removed: Callable[[int, str, tuple[BlockHash, ...]], int]

    # --- engines and events -----------------------------------------------------------

    def add_engine(self) -> int:
        """Empty containers for a new engine; returns its bit position."""
        engine = len(self._hashes)
        self._hashes.append({})
        self._retired.append({})
        self._present.append({})
        self._speculative.append({})
        return engine

    def apply(self, engine: int, event: IndexEvent, width: int) -> Counts:
        """One event of ``engine`` (a store's blocks ``width`` bytes of tokens each), in a
        medium the index follows and of its block size."""
        if isinstance(event, BlocksRemoved):  # most events by far: one call, no other
            # One event may name many blocks (the decoder joins a step's removals): the
            # per-block work is all in the base's loop.
            if event.medium not in self._present[engine]:
                return (("unknown_removed", len(event.block_hashes)),)
            unknown = self._removed(engine, event.medium, tuple(event.block_hashes))
            return (("unknown_removed", unknown),) if unknown else _NONE
        if isinstance(event, BlocksStored):
            return self._store(engine, event, width)
        if isinstance(event, BlocksUnkeyable):
            return self._store_unkeyed(engine, event)
        self.forget(engine, restarted=False)
        return _NONE

    def _store(self, engine: int, event: BlocksStored, width: int) -> Counts:
        if event.parent_hash is None:
            parent = self._root
        else:
            known = (self._hashes[engine].get(event.parent_hash)
                     or self._retired[engine].get(event.parent_hash))
            if known is None:
                return (("orphans", 1),)  # its parent was stored before we listened
            parent = known
        medium = event.medium
        self._medium(engine, medium)
        remapped, unkeyed = self._stored(
            engine, medium, parent, tuple(event.block_hashes), event.tokens, width
        )
        counts = self._bound(engine, medium)
        if remapped:
            counts = (*counts, ("hash_remapped", remapped))
        if unkeyed:
            counts = (*counts, ("unkeyable_stores", 1))
        return counts

    def _store_unkeyed(self, engine: int, event: BlocksUnkeyable) -> Counts:
        medium = event.medium
        present = self._medium(engine, medium)
        refcounted = medium in self._refcounted
        hashes, retired = self._hashes[engine], self._retired[engine]
        speculative = self._speculative[engine]
        remapped = 0
        for block_hash in event.block_hashes:
            previous = hashes.get(block_hash)
            if previous is None:
                previous = retired.pop(block_hash, None)
            key = unkeyed_key(self._prefix, block_hash)
            if previous is not None and previous != key:
                remapped += 1
            hashes.pop(block_hash, None)
            hashes[block_hash] = key
            count = present.pop(key, None)
            if count is None:
                present[key] = 1  # in no mask: no prompt names it (invariant 7)
            else:
                present[key] = count + 1 if refcounted else 1
            if speculative.pop((medium, key), None) is not None:
                drop_bit(self._speculating, (medium, key), 1 << engine)
        counts = self._bound(engine, medium)
        return (*counts, ("hash_remapped", remapped)) if remapped else counts

    def _medium(self, engine: int, medium: str) -> dict[bytes, int]:
        """The engine's blocks present in ``medium`` (the medium's table made if new)."""
        media = self._present[engine]
        present = media.get(medium)
        if present is None:
            if medium not in self._holders:
                self._holders[medium] = self._new_holders()
            present = media[medium] = {}
        return present

    def _bound(self, engine: int, medium: str) -> Counts:
        """Invariant 2: the oldest blocks out past ``max_blocks``, and mappings past twice."""
        present = self._present[engine][medium]
        counts = _NONE
        if len(present) > self._max_blocks:
            holders, prefix = self._holders[medium], self._prefix
            gone = oldest_out(present, self._max_blocks)
            for key in gone:
                drop_holder(holders, key, engine, prefix)
            counts = (("evicted_blocks", len(gone)),)
        oldest_out(self._hashes[engine], 2 * self._max_blocks)
        return counts

    def forget(self, engine: int, *, restarted: bool) -> None:
        """Drop what the engine holds in every medium and its speculative entries; a
        restarted engine's hashes name other blocks, so its mappings go too."""
        prefix = self._prefix
        media = self._present[engine]
        for medium, present in media.items():
            holders = self._holders[medium]
            for key in present:
                drop_holder(holders, key, engine, prefix)
        media.clear()
        speculative, bit = self._speculative[engine], 1 << engine
        for entry in speculative:
            drop_bit(self._speculating, entry, bit)
        speculative.clear()
        if restarted:
            self._hashes[engine].clear()
            self._retired[engine].clear()

    # --- speculation ------------------------------------------------------------------

    def speculate(self, engine: int, keys: Sequence[bytes], medium: str, now: float,
                  expiry: float) -> int:
        """Count ``keys`` as held by ``engine`` in ``medium`` until ``expiry`` or until an
        event stores them (invariant 4). Returns how many entries went past the bound."""
        self._drop_expired(engine, now)
        present: Mapping[bytes, int] = self._present[engine].get(medium, {})
        speculative, speculating, bit = self._speculative[engine], self._speculating, 1 << engine
        for key in keys:
            if key not in present:
                entry = (medium, key)
                speculative.pop(entry, None)  # re-insert as the newest
                speculative[entry] = expiry
                speculating[entry] = speculating.get(entry, 0) | bit
        if len(speculative) > self._max_speculative:
            return self._trim_speculative(engine, now)
        return 0

    def _drop_expired(self, engine: int, now: float) -> None:
        """Drop expired entries from the front: entries go in (or back in) as the newest,
        so with one TTL the oldest expire first and this costs what it removes. Without
        it expired entries stayed until ``max_speculative`` (20,000 per engine) was
        passed."""
        speculative, bit = self._speculative[engine], 1 << engine
        while speculative:
            oldest = next(iter(speculative))
            if speculative[oldest] > now:
                return
            del speculative[oldest]
            drop_bit(self._speculating, oldest, bit)

    def _trim_speculative(self, engine: int, now: float) -> int:
        speculative, bit = self._speculative[engine], 1 << engine
        for entry in [e for e, expiry in speculative.items() if expiry <= now]:
            del speculative[entry]
            drop_bit(self._speculating, entry, bit)
        dropped = 0
        while len(speculative) > self._max_speculative:
            entry = next(iter(speculative))
            del speculative[entry]
            drop_bit(self._speculating, entry, bit)
            dropped += 1
        return dropped

    # --- queries ----------------------------------------------------------------------

    def prefixes(self, keys: Sequence[bytes], medium: str, alive: int, now: float
                 ) -> list[tuple[int, int]]:
        """Blocks of the longest prefix of ``keys`` that each engine whose bit is in
        ``alive`` holds in ``medium`` (confirmed blocks and unexpired speculative ones),
        in one walk of the keys with the masks (invariant 7): ``(engines' bits, blocks)``
        for the engines holding at least one block (any other holds 0)."""
        out: list[tuple[int, int]] = []
        holders = self._holders.get(medium, _NO_HOLDERS)
        speculating = self._speculating
        blocks = 0
        for key in keys:
            held = holders.get(key, 0)
            if speculating:
                maybe = speculating.get((medium, key), 0) & alive & ~held
                if maybe:
                    held |= self._unexpired(maybe, (medium, key), now)
            still = alive & held
            if still != alive:
                if blocks:
                    out.append((alive ^ still, blocks))
                alive = still
                if not alive:
                    return out
            blocks += 1
        if blocks:
            out.append((alive, blocks))
        return out

    def _unexpired(self, bits: int, entry: tuple[str, bytes], now: float) -> int:
        """Those of ``bits`` whose speculative ``entry`` has not expired."""
        live = 0
        while bits:
            low = bits & -bits
            if self._speculative[low.bit_length() - 1][entry] > now:
                live |= low
            bits ^= low
        return live

    def statistics(self, engine: int, now: float) -> tuple[dict[str, int], int, int]:
        """(blocks held per medium, live speculative entries, hash mappings live and
        retired) of ``engine``."""
        return (
            {medium: len(keys) for medium, keys in self._present[engine].items()},
            sum(1 for expiry in self._speculative[engine].values() if expiry > now),
            len(self._hashes[engine]) + len(self._retired[engine]),
        )


class _PythonCore(indexloops.Core, CoreMethods):
    _new_holders = indexloops.Holders


_NativeCore: type[CoreMethods] | None
try:  # the containers and loops in C, when built (setup.py: an optional extension)
    from kvpeer.router._intake import Core as _NativeBase
    from kvpeer.router._intake import Holders as _NativeHolders
except ImportError:  # pragma: no cover - a machine without a C compiler
    _NativeCore = None
else:
    class _CCore(_NativeBase, CoreMethods):
        _new_holders = _NativeHolders

    _NativeCore = _CCore


def new_core(
    native: bool, *, refcounted: frozenset[str], root: bytes, unkeyed_prefix: bytes,
    max_blocks: int, max_retired: int, max_speculative: int,
) -> CoreMethods:
    """A core over the C base (``native``; it must be built) or the Python reference."""
    cls: type[CoreMethods] = _PythonCore
    if native:
        if _NativeCore is None:
            raise RuntimeError(
                "native=True, but kvpeer.router._intake is not built (no C compiler at install?)"
            )
        cls = _NativeCore
    core = cls(refcounted, max_retired, unkeyed_prefix)  # type: ignore[call-arg]
    core._root, core._max_blocks, core._max_speculative = root, max_blocks, max_speculative
    return core
