"""What each engine holds, per medium, keyed by token content.

Engines name blocks by hashes the router cannot recompute (salted per process unless
``PYTHONHASHSEED`` is fixed, and ``bytes`` or ``int`` by configuration). So the index
keys every full block by a *chain key* of its own: ``sha256(parent_key || tokens)``,
computed from token ids alone, and maps each engine's hashes onto chain keys as its
``BlockStored`` events arrive (each event carries its parent's hash and its tokens).
A prompt resolves to chain keys once (:meth:`PrefixIndex.keys`), and each engine and
medium answers ``longest_prefix`` in O(prompt blocks).

Invariants:

1. An engine that is not :meth:`~PrefixIndex.learned` answers 0 for every prefix: after a
   router restart, an engine restart or lost events, routing for that engine is by load
   only until its stream is followed again (never stale affinity).
2. Memory is bounded: at most ``max_blocks`` chain keys per engine and medium (oldest
   stored first out, down to seven eighths of the bound at a time: a plain dict finds
   its oldest by walking past the slots of earlier deletions), ``2 * max_blocks`` hash
   mappings, ``max_speculative`` speculative
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
7. Every engine has a bit of its own, and each medium keeps, for every chain key some
   engine holds there, the bits of the engines holding it (the core's ``_holders``;
   speculative entries likewise in ``_speculating``): a bit is set exactly while that
   engine's present (or speculative) entries hold the key. An unkeyed key (invariant 6)
   is in no mask: no prompt names it. :meth:`PrefixIndex.prefixes` walks a prompt once
   for the whole fleet with these masks and answers what
   :meth:`~PrefixIndex.longest_prefix` answers for every engine (at 256 engines one walk
   per engine and medium was the largest part of a decision after scoring). With the C
   core the masks of a medium are a table of their own (``kvpeer.router._intake.Holders``:
   16-byte keys and their masks inline, placed by their own bits, on huge pages when
   large), else ``kvpeer.router.indexloops.Holders``, its Python reference: a dict's
   index, entry, key object and int object were four cache misses per block at 256
   engines, the table's slot one.
8. A hash already mapped (live or retired) keeps its chain key when stored again under a
   keyed parent: vLLM derives a block's hash from its parent's hash and its tokens, so a
   known hash names known content, and its key is not hashed again. The CPU tier
   announces the blocks the GPU prefix cache announced, under the same hashes, and the
   prefix cache may announce a block again: this halves the intake's hashing. (Only a
   change between keyed and unkeyed counts as ``hash_remapped``.)
9. The large maps (hash mappings, blocks held) are plain dicts of bytes and
   ints, in insertion order (a touch deletes and re-inserts), which the garbage
   collector never tracks. As ``OrderedDict`` they were tracked, and every full
   collection -- set off by the decoder's short-lived objects -- walked every block of
   every engine: at 256 engines, half of the intake's CPU (``docs/scale.md``).
10. What engines hold is one object, the index's *core* (``router/indexcore.py``), behind
    six methods: add an engine, apply an event, speculate, the longest held prefix of
    one engine or of many in one walk, forget an engine, statistics. ``PrefixIndex``
    keeps only names, the block size, learned bits and counters, and never touches a
    container. The core's containers and the two loops every block goes through
    (``_stored``, ``_removed``) are the C extension's ``kvpeer.router._intake.Core`` when
    it is built (``native``), else ``kvpeer.router.indexloops.Core``, its reference with
    the same interface: both leave the same state, order included
    (``tests/router/test_index_native.py``). Chain keys are hashed by the extension
    (OpenSSL's SHA-256) when it is built (hashlib's otherwise: the same keys, compared in
    the same tests), so a new block costs no Python call.
11. Chain keys are the router's own: SHA-256 truncated to 16 bytes, chained from a root
    drawn at random when the process starts (``_ROOT``) and never shown outside it. No
    engine or client can compute a key, so none can aim token contents at another
    prefix's key or at one slot of the holder table (which places keys by their own
    bits); a chance collision needs about 2**64 keys. Keys are not comparable between
    router processes, and nothing compares them.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Final

from kvpeer.router import indexloops
from kvpeer.router.feed import FeedItem, StreamReset, StreamSynced
from kvpeer.router.indexcore import Counts, new_core
from kvpeer.router.kvevents import AllCleared, BlocksRemoved, BlocksStored, BlocksUnkeyable

_native_intake: ModuleType | None
try:  # the per-block loops in C, when built (setup.py: an optional extension)
    from kvpeer.router import _intake as _native_intake
except ImportError:  # pragma: no cover - a machine without a C compiler
    _native_intake = None

__all__ = ["MEDIUM_CPU", "MEDIUM_GPU", "IndexStatistics", "PrefixIndex", "PromptKeys"]

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
_ROOT: Final = secrets.token_bytes(16)  # invariant 11: this process's own, never shown
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
    index: int  # this engine's bit position in the masks and the core (invariant 7)
    learned: bool = False

    @property
    def bit(self) -> int:
        """This engine's bit in the masks."""
        return 1 << self.index


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
        native: bool | None = None,
    ) -> None:
        """``block_size`` as the engines run (``None``: adopt the first stored event's).

        ``native``: keep what engines hold in the C core of ``kvpeer.router._intake``
        (``None``: when built; ``True``: required) or in its Python reference
        (``False``): both leave the same state.
        """
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if native and _native_intake is None:
            raise RuntimeError(
                "native=True, but kvpeer.router._intake is not built (no C compiler at install?)"
            )
        self._block_size = block_size
        self._media = frozenset(media)
        self._native = native is not False and _native_intake is not None
        self._core = new_core(
            self._native, refcounted=frozenset(refcounted_media), root=_ROOT,
            unkeyed_prefix=_UNKEYED, max_blocks=max_blocks, max_retired=max_retired,
            max_speculative=max_speculative,
        )
        self._engines: dict[str, _Engine] = {}
        self._names: list[str] = []  # by bit
        self._learned_bits = 0
        self._counts: dict[str, int] = {}

    @property
    def block_size(self) -> int | None:
        return self._block_size

    @property
    def native(self) -> bool:
        """Whether what engines hold is kept by the C core."""
        return self._native

    # --- queries ----------------------------------------------------------------------

    def keys(self, prompt: Sequence[int]) -> PromptKeys:
        """Chain keys of the prompt's full blocks (none while the block size is unknown).

        Keys stop at the first block with a token id outside ``[0, 2**32)``: no engine
        can hold it.
        """
        size = self._block_size
        if size is None:
            return PromptKeys(0, (), len(prompt))
        full = len(prompt) - len(prompt) % size
        try:
            tokens = array("I", prompt[:full]).tobytes()
        except (OverflowError, TypeError):  # keep the blocks before the first bad one
            return self._keys_checked(prompt, size)
        return PromptKeys(size, _chain_keys(_ROOT, tokens, 4 * size), len(prompt))

    def _keys_checked(self, prompt: Sequence[int], size: int) -> PromptKeys:
        keys: list[bytes] = []
        parent = _ROOT
        for start in range(0, len(prompt) - size + 1, size):
            try:
                block = array("I", prompt[start : start + size]).tobytes()
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
        held = self._core.prefixes(prompt.keys, medium, state.bit, now)
        return held[0][1] * prompt.block_size if held else 0

    def prefixes(self, prompt: PromptKeys, medium: str, now: float) -> dict[str, int]:
        """:meth:`longest_prefix` of every engine at once, for the engines holding at
        least one block of the prompt (any other engine holds 0): one walk of the prompt
        for the whole fleet (invariant 7)."""
        out: dict[str, int] = {}
        if prompt.block_size != self._block_size:
            return out
        names = self._names
        for holding, blocks in self._core.prefixes(prompt.keys, medium, self._learned_bits, now):
            tokens, bits = blocks * prompt.block_size, holding
            while bits:
                low = bits & -bits
                out[names[low.bit_length() - 1]] = tokens
                bits ^= low
        return out

    def learned(self, engine: str) -> bool:
        """Whether the engine's stream is followed (invariant 1)."""
        state = self._engines.get(engine)
        return state is not None and state.learned

    def statistics(self, now: float) -> IndexStatistics:
        held = {name: self._core.statistics(state.index, now)
                for name, state in sorted(self._engines.items())}
        return IndexStatistics(
            block_size=self._block_size,
            engines=len(self._engines),
            learned=sum(1 for s in self._engines.values() if s.learned),
            blocks=tuple(
                (name, medium, blocks)
                for name, (media, _, _) in held.items()
                for medium, blocks in sorted(media.items())
            ),
            speculative=tuple((name, live) for name, (_, live, _) in held.items()),
            counts=tuple(sorted(self._counts.items())),
            hash_mappings=tuple((name, mappings) for name, (_, _, mappings) in held.items()),
        )

    # --- updates ----------------------------------------------------------------------

    def apply(self, engine: str, item: FeedItem) -> None:
        """Apply one item of the engine's feed (events, resets, sync)."""
        state = self._engines.get(engine) or self._engine(engine)
        if isinstance(item, BlocksRemoved):  # most events by far
            self._count(self._core.apply(state.index, item, 0))
        elif isinstance(item, BlocksStored):
            self._stored(state, item)
        elif isinstance(item, BlocksUnkeyable):
            if item.medium in self._media:
                self._count(self._core.apply(state.index, item, 0))
            else:
                self._bump("ignored_medium")
        elif isinstance(item, AllCleared):
            self._core.forget(state.index, restarted=False)
            self._bump("cleared")
        elif isinstance(item, StreamReset):
            self._forget(state, restarted=item.restarted)
        elif isinstance(item, StreamSynced):
            state.learned = True
            self._learned_bits |= state.bit

    def speculate(
        self, engine: str, prompt: PromptKeys, medium: str, now: float, ttl: float
    ) -> None:
        """The router just sent this prompt to ``engine``: count its blocks as held in
        ``medium`` until ``now + ttl`` or until an event confirms them (invariant 4)."""
        if prompt.block_size != self._block_size or not prompt.keys:
            return
        state = self._engines.get(engine) or self._engine(engine)
        dropped = self._core.speculate(state.index, prompt.keys, medium, now, now + ttl)
        if dropped:
            self._bump("speculative_dropped", dropped)

    def forget(self, engine: str) -> None:
        """The engine restarted (or is unknown again): drop everything it held and the
        mapping of its hashes; it is unlearned until its stream syncs again."""
        state = self._engines.get(engine)
        if state is not None:
            self._forget(state, restarted=True)

    # --- internals --------------------------------------------------------------------

    def _engine(self, engine: str) -> _Engine:
        index = self._core.add_engine()
        state = self._engines[engine] = _Engine(index)
        self._names.append(engine)
        return state

    def _stored(self, state: _Engine, event: BlocksStored) -> None:
        if event.medium not in self._media:
            self._bump("ignored_medium")
            return
        if self._block_size is None:
            self._block_size = event.block_size
        if event.block_size != self._block_size:
            self._bump("block_size_mismatch")
            return
        self._count(self._core.apply(state.index, event, 4 * self._block_size))

    def _forget(self, state: _Engine, *, restarted: bool) -> None:
        self._core.forget(state.index, restarted=restarted)
        state.learned = False
        self._learned_bits &= ~state.bit
        self._bump("forgotten")

    def _count(self, counts: Counts) -> None:
        for name, by in counts:
            self._bump(name, by)

    def _bump(self, name: str, by: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + by


# The chain keys of prompts and of the stored loop: hashed in C when built (OpenSSL's
# SHA-256, compared with hashlib's in tests/router/test_index_native.py), so the stored
# loop calls no Python per block.
_chain: Callable[[bytes, bytes], bytes] = (
    indexloops.chain if _native_intake is None else _native_intake.chain
)
_chain_keys: Callable[[bytes, bytes, int], tuple[bytes, ...]] = (
    indexloops.chain_keys if _native_intake is None else _native_intake.chain_keys
)
