"""The router's KV events: what an engine's cache did, in the terms the index applies.

:mod:`~kvpeer.router.events` decodes vLLM's published batches into these values,
:mod:`~kvpeer.router.feed` hands them on in order (with its resets), the prefix index
(:mod:`~kvpeer.router.index`) applies them, and the fleet model's simulated engines
make them directly. They say which blocks an engine now holds or no longer holds, in
which medium; a block is named by its engine's hash (:data:`BlockHash`, opaque) and
placed by its tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "AllCleared",
    "BlockHash",
    "BlocksRemoved",
    "BlocksStored",
    "BlocksUnkeyable",
    "KVEvent",
]

BlockHash = bytes | int
"""An engine's block hash as published: sha256 bytes, or a 64-bit int when vLLM runs
with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``. Opaque to the router."""


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """The engine now holds these consecutive blocks in ``medium``.

    ``tokens`` are the blocks' token ids packed as ``array("I")`` packs them (uint32,
    native byte order), exactly ``len(block_hashes) * block_size`` of them;
    ``parent_hash`` is the engine's hash of the block before the first one (``None``:
    the first block starts the prompt).
    """

    medium: str
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    tokens: bytes
    block_size: int

    @classmethod
    def of_ids(
        cls,
        medium: str,
        block_hashes: tuple[BlockHash, ...],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> BlocksStored:
        """The event with its token ids given as ints (each in ``[0, 2**32)``)."""
        return cls(medium, block_hashes, parent_hash, array("I", token_ids).tobytes(), block_size)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(array("I", self.tokens))


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """The engine no longer holds these blocks in ``medium``."""

    medium: str
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The engine reset its prefix cache (``AllBlocksCleared``).

    vLLM emits it from the GPU block pool, and a CPU-tier reset that may come with it
    emits nothing, so the index forgets every medium: never stale affinity.
    """


@dataclass(frozen=True, slots=True)
class BlocksUnkeyable:
    """The engine stored these blocks in ``medium`` under extra keys (cache salt, LoRA,
    multimodal) that the router cannot see in a prompt: the index holds them under keys
    no prompt matches, and so later stores of the same blocks and their children. vLLM
    0.32's CPU-tier events for a block carry its GPU hash but never its extra keys, so a
    salted block offloaded to the CPU tier would otherwise be keyed as the unsalted
    prompt."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = "GPU"


KVEvent = BlocksStored | BlocksRemoved | AllCleared | BlocksUnkeyable
