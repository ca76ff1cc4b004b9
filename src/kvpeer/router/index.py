"""What each engine holds, per medium, keyed by token content.

Engines name blocks by hashes the router cannot recompute (salted per process unless
``PYTHONHASHSEED`` is fixed, and ``bytes`` or ``int`` by configuration). So the index
keys every full block by a *chain key* of its own: ``blake2b(parent_key || tokens)``,
computed from token ids alone, and maps each engine's hashes onto chain keys as its
``BlockStored`` events arrive (each event carries its parent's hash and its tokens).
A prompt resolves to chain keys once (:meth:`PrefixIndex.keys`), and each engine and
medium answers ``longest_prefix`` in O(prompt blocks).

Invariants:

1. An engine that is not :meth:`~PrefixIndex.learned` answers 0 for every prefix: after a
   router restart, an engine restart or lost events, routing for that engine is by load
   only until its stream is followed again (never stale affinity).
2. Memory is bounded: at most ``max_blocks`` chain keys per engine and medium (oldest
   stored first out), ``2 * max_blocks`` hash mappings, ``max_speculative`` speculative
   entries per engine. A block removed from every medium keeps its hash mapping only
   among the ``max_retired`` most recently removed (a child stored soon after its
   parent's eviction still attaches): the mappings track what engines hold, not
   everything they ever stored (``kvpeer soak`` saw a router grow by ~184 bytes per
   block stored and removed, up to ~70 MiB per engine at the old cap).
3. ``refcounted_media`` (the CPU tier) count announcements: vLLM's offloading events may
   announce a block once per chunk that contains it and remove it as often. The GPU
   prefix cache re-announces reused blocks without matching removals, so its media keep
   set semantics (one removal removes).
4. Speculative entries (what the router just sent somewhere) count until their expiry or
   until an event stores the same block, whichever is first.
5. The index is not thread-safe: the edge's event loop owns it (the subscribers and the
   policy run on that loop).
6. A block stored under extra keys (cache salt, LoRA: :class:`BlocksUnkeyable`) is held
   under a key of its own, derived from its engine hash, that no prompt's chain key can
   equal; so are its children and any later store of the same hash. vLLM 0.32's CPU-tier
   events carry a salted block's hash without its salt, and keying it by its tokens would
   tell the router the engine holds the unsalted prompt (and let the salted copy's
   eviction remove the real one). Being held like any block, such blocks are forgotten
   as the engine removes them (invariant 2's bound); a list of skipped hashes of its own
   (the first fix) grew with traffic up to its cap, ~2 MiB per engine. ``kvpeer soak``
   found it: every request's salted reference left a hash mapping behind (a router's
   mappings of one engine grew by ~2,000 a minute, to 22,000 against 550 blocks held).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvpeer.router.events import (
    AllCleared,
    BlockHash,
    BlocksRemoved,
    BlocksStored,
    BlocksUnkeyable,
)
from kvpeer.router.feed import FeedItem, StreamReset, StreamSynced

__all__ = ["MEDIUM_CPU", "MEDIUM_GPU", "IndexStatistics", "PrefixIndex", "PromptKeys"]

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
_ROOT: Final = b"kvpeer-router-chain-root"
_CHAIN_BYTES: Final = 16
_UNKEYED: Final = b"kvpeer-unkeyed:"


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """A prompt's full blocks as chain keys; compute once per request, ask every engine."""

    block_size: int
    keys: tuple[bytes, ...]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class IndexStatistics:
    block_size: int | None
    engines: int
    learned: int
    blocks: tuple[tuple[str, str, int], ...]  # (engine, medium, blocks held)
    speculative: tuple[tuple[str, int], ...]  # (engine, live speculative entries)
    counts: tuple[tuple[str, int], ...]  # named counters: orphans, evictions, ...
    hash_mappings: tuple[tuple[str, int], ...] = ()  # (engine, live + retired mappings)


@dataclass(slots=True)
class _Engine:
    learned: bool = False
    hashes: OrderedDict[BlockHash, bytes] = field(default_factory=OrderedDict)
    retired: OrderedDict[BlockHash, bytes] = field(default_factory=OrderedDict)
    present: dict[str, OrderedDict[bytes, int]] = field(default_factory=dict)
    speculative: dict[tuple[str, bytes], float] = field(default_factory=dict)


class PrefixIndex:
    """Prefix index per engine and medium (see the module docstring)."""

    def __init__(
        self,
        block_size: int | None = None,
        *,
        media: Iterable[str] = (MEDIUM_GPU, MEDIUM_CPU),
        refcounted_media: Iterable[str] = (MEDIUM_CPU,),
        max_blocks: int = 200_000,
        max_speculative: int = 20_000,
        max_retired: int = 2_048,
    ) -> None:
        """``block_size`` as the engines run (``None``: adopt the first stored event's)."""
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self._block_size = block_size
        self._media = frozenset(media)
        self._refcounted = frozenset(refcounted_media)
        self._max_blocks = max_blocks
        self._max_speculative = max_speculative
        self._max_retired = max_retired
        self._engines: dict[str, _Engine] = {}
        self._counts: dict[str, int] = {}

    @property
    def block_size(self) -> int | None:
        return self._block_size

    # --- queries ----------------------------------------------------------------------

    def keys(self, prompt: Sequence[int]) -> PromptKeys:
        """Chain keys of the prompt's full blocks (none while the block size is unknown).

        Keys stop at the first block with a token id outside ``[0, 2**32)``: no engine
        can hold it.
        """
        size = self._block_size
        if size is None:
            return PromptKeys(0, (), len(prompt))
        keys: list[bytes] = []
        parent = _ROOT
        for start in range(0, len(prompt) - size + 1, size):
            try:
                block = array("I", prompt[start : start + size])
            except (OverflowError, TypeError):
                break
            parent = _chain(parent, block)
            keys.append(parent)
        return PromptKeys(size, tuple(keys), len(prompt))

    def longest_prefix(self, engine: str, prompt: PromptKeys, medium: str, now: float) -> int:
        """Tokens of the prompt's longest prefix that ``engine`` holds in ``medium``.

        Counts confirmed blocks and unexpired speculative ones; 0 if not learned.
        """
        state = self._engines.get(engine)
        if state is None or not state.learned or prompt.block_size != self._block_size:
            return 0
        present = state.present.get(medium)
        speculative = state.speculative
        blocks = 0
        for key in prompt.keys:
            if present is not None and key in present:
                blocks += 1
                continue
            expiry = speculative.get((medium, key))
            if expiry is None or expiry <= now:
                break
            blocks += 1
        return blocks * prompt.block_size

    def learned(self, engine: str) -> bool:
        """Whether the engine's stream is followed (invariant 1)."""
        state = self._engines.get(engine)
        return state is not None and state.learned

    def statistics(self, now: float) -> IndexStatistics:
        blocks = tuple(
            (name, medium, len(keys))
            for name, state in sorted(self._engines.items())
            for medium, keys in sorted(state.present.items())
        )
        speculative = tuple(
            (name, sum(1 for expiry in state.speculative.values() if expiry > now))
            for name, state in sorted(self._engines.items())
        )
        return IndexStatistics(
            block_size=self._block_size,
            engines=len(self._engines),
            learned=sum(1 for s in self._engines.values() if s.learned),
            blocks=blocks,
            speculative=speculative,
            counts=tuple(sorted(self._counts.items())),
            hash_mappings=tuple(
                (name, len(state.hashes) + len(state.retired))
                for name, state in sorted(self._engines.items())
            ),
        )

    # --- updates ----------------------------------------------------------------------

    def apply(self, engine: str, item: FeedItem) -> None:
        """Apply one item of the engine's feed (events, resets, sync)."""
        state = self._engines.setdefault(engine, _Engine())
        if isinstance(item, BlocksStored):
            self._stored(state, item)
        elif isinstance(item, BlocksRemoved):
            self._removed(state, item)
        elif isinstance(item, BlocksUnkeyable):
            self._stored_unkeyable(state, item)
        elif isinstance(item, AllCleared):
            state.present.clear()
            state.speculative.clear()
            self._bump("cleared")
        elif isinstance(item, StreamReset):
            self._forget(state, restarted=item.restarted)
        elif isinstance(item, StreamSynced):
            state.learned = True

    def speculate(
        self, engine: str, prompt: PromptKeys, medium: str, now: float, ttl: float
    ) -> None:
        """The router just sent this prompt to ``engine``: count its blocks as held in
        ``medium`` until ``now + ttl`` or until an event confirms them (invariant 4)."""
        if prompt.block_size != self._block_size or not prompt.keys:
            return
        state = self._engines.setdefault(engine, _Engine())
        _drop_expired(state.speculative, now)
        present: Mapping[bytes, int] = state.present.get(medium, {})
        expiry = now + ttl
        for key in prompt.keys:
            if key not in present:
                state.speculative.pop((medium, key), None)  # re-insert as the newest
                state.speculative[(medium, key)] = expiry
        if len(state.speculative) > self._max_speculative:
            self._trim_speculative(state, now)

    def forget(self, engine: str) -> None:
        """The engine restarted (or is unknown again): drop everything it held and the
        mapping of its hashes; it is unlearned until its stream syncs again."""
        state = self._engines.get(engine)
        if state is not None:
            self._forget(state, restarted=True)

    # --- internals --------------------------------------------------------------------

    def _stored(self, state: _Engine, event: BlocksStored) -> None:
        if event.medium not in self._media:
            self._bump("ignored_medium")
            return
        if self._block_size is None:
            self._block_size = event.block_size
        if event.block_size != self._block_size:
            self._bump("block_size_mismatch")
            return
        if event.parent_hash is None:
            parent = _ROOT
        else:
            known = self._mapping(state, event.parent_hash)
            if known is None:
                self._bump("orphans")  # its parent was stored before we listened
                return
            parent = known
        size = self._block_size
        unkeyed = False
        for i, block_hash in enumerate(event.block_hashes):
            previous = self._mapping(state, block_hash)
            if _is_unkeyed(parent) or (previous is not None and _is_unkeyed(previous)):
                parent = _unkeyed(block_hash)  # a salted block or its child (invariant 6)
                unkeyed = True
            else:
                parent = _chain(parent, array("I", event.token_ids[i * size : (i + 1) * size]))
            self._hold(state, event.medium, block_hash, parent, previous)
        if unkeyed:
            self._bump("unkeyable_stores")
        self._bound(state, event.medium)

    def _stored_unkeyable(self, state: _Engine, event: BlocksUnkeyable) -> None:
        if event.medium not in self._media:
            self._bump("ignored_medium")
            return
        for block_hash in event.block_hashes:
            previous = self._mapping(state, block_hash)
            self._hold(state, event.medium, block_hash, _unkeyed(block_hash), previous)
        self._bound(state, event.medium)

    @staticmethod
    def _mapping(state: _Engine, block_hash: BlockHash) -> bytes | None:
        """The key ``block_hash`` maps to, live or retired (None: not known)."""
        known = state.hashes.get(block_hash)
        return known if known is not None else state.retired.get(block_hash)

    def _hold(
        self,
        state: _Engine,
        medium: str,
        block_hash: BlockHash,
        key: bytes,
        previous: bytes | None,
    ) -> None:
        """The engine holds ``block_hash`` (keyed ``key``) in ``medium``."""
        if previous is not None and previous != key:
            self._bump("hash_remapped")
        state.hashes[block_hash] = key
        state.hashes.move_to_end(block_hash)
        state.retired.pop(block_hash, None)
        present = state.present.setdefault(medium, OrderedDict())
        present[key] = present.get(key, 0) + 1 if medium in self._refcounted else 1
        present.move_to_end(key)
        state.speculative.pop((medium, key), None)

    def _bound(self, state: _Engine, medium: str) -> None:
        present = state.present.get(medium)
        while present is not None and len(present) > self._max_blocks:
            present.popitem(last=False)
            self._bump("evicted_blocks")
        while len(state.hashes) > 2 * self._max_blocks:
            state.hashes.popitem(last=False)

    def _removed(self, state: _Engine, event: BlocksRemoved) -> None:
        present = state.present.get(event.medium)
        if present is None:
            self._bump("unknown_removed", len(event.block_hashes))
            return
        refcounted = event.medium in self._refcounted
        for block_hash in event.block_hashes:
            key = state.hashes.get(block_hash)
            count = present.get(key) if key is not None else None
            if key is None or count is None:
                self._bump("unknown_removed")
                continue
            if refcounted and count > 1:
                present[key] = count - 1
                continue
            del present[key]
            if not any(key in held for held in state.present.values()):
                self._retire(state, block_hash, key)

    def _retire(self, state: _Engine, block_hash: BlockHash, key: bytes) -> None:
        """``block_hash``'s block left every medium: keep its mapping among the
        ``max_retired`` most recent only (invariant 2)."""
        del state.hashes[block_hash]
        state.retired[block_hash] = key
        state.retired.move_to_end(block_hash)
        while len(state.retired) > self._max_retired:
            state.retired.popitem(last=False)

    def _forget(self, state: _Engine, *, restarted: bool) -> None:
        state.present.clear()
        state.speculative.clear()
        if restarted:
            state.hashes.clear()
            state.retired.clear()
        state.learned = False
        self._bump("forgotten")

    def _trim_speculative(self, state: _Engine, now: float) -> None:
        for entry in [e for e, expiry in state.speculative.items() if expiry <= now]:
            del state.speculative[entry]
        while len(state.speculative) > self._max_speculative:
            del state.speculative[next(iter(state.speculative))]
            self._bump("speculative_dropped")

    def _bump(self, name: str, by: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + by


def _drop_expired(speculative: dict[tuple[str, bytes], float], now: float) -> None:
    """Drop expired entries from the front: entries go in (or back in) as the newest, so
    with one TTL the oldest expire first and this costs what it removes. Without it
    expired entries stayed until ``max_speculative`` (20,000 per engine) was passed."""
    while speculative:
        oldest = next(iter(speculative))
        if speculative[oldest] > now:
            return
        del speculative[oldest]


def _chain(parent: bytes, tokens: array[int]) -> bytes:
    return hashlib.blake2b(parent + tokens.tobytes(), digest_size=_CHAIN_BYTES).digest()


def _unkeyed(block_hash: BlockHash) -> bytes:
    """The key of a block under extra keys: its engine hash behind a prefix no chain key
    has, so no prompt resolves to it (invariant 6)."""
    raw = block_hash if isinstance(block_hash, bytes) else b"%d" % block_hash
    return _UNKEYED + raw


def _is_unkeyed(key: bytes) -> bool:
    return key.startswith(_UNKEYED)  # a chain key has it by chance with p = 2**-120
