"""Prompts of the simulation: chained block keys and the bytes every node computes.

Keys follow docs/design.md section 2: ``sha256(parent key + block tokens)[:16]``
followed by the 4-byte group index (always 0 here), so two prompts that share
their first blocks share those keys, and a prompt that extends another one
shares all of its keys. A block's bytes are a pure function of its key, so
every node that computes a key writes identical bytes and any slot can be
checked against :meth:`Blocks.content`.
"""

from __future__ import annotations

import hashlib
import random

from kvpeer.types import Key

__all__ = ["Blocks", "PromptBook", "chain"]

_GROUP = (0).to_bytes(4, "big")


def chain(parent: Key | None, tokens: bytes) -> Key:
    """The key of a block whose tokens are ``tokens``, after ``parent``."""
    prefix = parent[:16] if parent is not None else b""
    return hashlib.sha256(prefix + tokens).digest()[:16] + _GROUP


class Blocks:
    """The bytes of each key (cached): ``sha256(key)`` repeated to ``block_len``."""

    def __init__(self, block_len: int) -> None:
        self.block_len = block_len
        self._cache: dict[Key, bytes] = {}

    def content(self, key: Key) -> bytes:
        data = self._cache.get(key)
        if data is None:
            digest = hashlib.sha256(key).digest()
            data = (digest * (self.block_len // len(digest) + 1))[: self.block_len]
            self._cache[key] = data
        return data


class PromptBook:
    """Families of prompts that share prefixes and grow over rounds.

    A new prompt is either a fresh root, or an earlier prompt (recent ones
    preferred) extended by a few blocks, re-asked as is, or cut short.
    """

    def __init__(self, rng: random.Random, max_blocks: int, keep: int = 40) -> None:
        self._rng = rng
        self._max_blocks = max_blocks
        self._keep = keep
        self._prompts: list[tuple[Key, ...]] = []

    def next_prompt(self) -> tuple[Key, ...]:
        rng = self._rng
        if not self._prompts or rng.random() < 0.25:
            prompt = self._extend((), rng.randint(2, 6))
        else:
            # Recent prompts are likelier to be continued (a conversation goes on).
            index = len(self._prompts) - 1 - min(int(rng.expovariate(0.3)), len(self._prompts) - 1)
            base = self._prompts[index]
            roll = rng.random()
            if roll < 0.6:
                prompt = self._extend(base, rng.randint(1, 4))
            elif roll < 0.8:
                prompt = base
            else:
                prompt = base[: rng.randint(1, len(base))]
        self._prompts.append(prompt)
        if len(self._prompts) > self._keep:
            del self._prompts[0]
        return prompt

    def _extend(self, base: tuple[Key, ...], count: int) -> tuple[Key, ...]:
        keys = list(base[: self._max_blocks - 1])
        parent = keys[-1] if keys else None
        for _ in range(min(count, self._max_blocks - len(keys))):
            parent = chain(parent, self._rng.getrandbits(64).to_bytes(8, "big"))
            keys.append(parent)
        return tuple(keys)
