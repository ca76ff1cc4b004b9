"""Token ids for a trace's block ids: each id is one fixed block of tokens.

The block of an id is a pure function of ``(id, seed, vocab)``: two requests that share
an id share that block's tokens, and so, in order, their prefix. Its first tokens spell
the id in base ``vocab - reserved`` (distinct ids give distinct blocks for any id below
``(vocab - reserved) ** 3``); the rest are pseudo-random from a 64-bit mix of id and
seed. Token ids lie in ``[reserved, vocab)``, clear of a tokenizer's special tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvpeer.errors import ConfigError
from kvpeer.lab.trace.mooncake import TraceRequest

__all__ = ["BlockTokens"]

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit function of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class BlockTokens:
    """Blocks of ``block_tokens`` token ids by trace id (module docstring); the most
    recent ``cache`` blocks are kept, so a shared prefix is built once."""

    def __init__(
        self, block_tokens: int, *, vocab: int = 32_000, reserved: int = 16, seed: int = 0,
        cache: int = 65_536,
    ) -> None:
        if block_tokens < 1:
            raise ConfigError(f"block_tokens must be >= 1, not {block_tokens}")
        if vocab - reserved < 2:
            raise ConfigError(f"vocab {vocab} leaves no room above {reserved} reserved ids")
        self.block_tokens = block_tokens
        self._base = vocab - reserved
        self._reserved = reserved
        self._seed = seed
        self._cache: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._limit = cache

    def block(self, block_id: int) -> tuple[int, ...]:
        cached = self._cache.get(block_id)
        if cached is not None:
            self._cache.move_to_end(block_id)
            return cached
        base, low, size = self._base, self._reserved, self.block_tokens
        spelled = [low + block_id % base, low + block_id // base % base,
                   low + block_id // (base * base) % base]
        state = _mix(block_id ^ (self._seed << 1))
        step = _mix(state) | 1
        rest = [low + ((state + i * step) & _MASK) % base for i in range(max(0, size - 3))]
        tokens = tuple((spelled + rest)[:size])
        self._cache[block_id] = tokens
        if len(self._cache) > self._limit:
            self._cache.popitem(last=False)
        return tokens

    def prompt(self, request: TraceRequest) -> list[int]:
        """The request's prompt: its blocks in order, cut to ``input_length``."""
        return self.blocks(request.hash_ids, request.input_length)

    def blocks(self, block_ids: Sequence[int], length: int) -> list[int]:
        out: list[int] = []
        for block_id in block_ids:
            out.extend(self.block(block_id))
            if len(out) >= length:
                break
        del out[length:]
        return out
