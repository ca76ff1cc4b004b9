"""A prompt's offload keys, computed as this engine's scheduler will compute them.

Pulling ahead (:mod:`kvpeer.node.ahead`) is told a prompt's tokens by the router and
must fetch the blocks under the keys the scheduler will look up. vLLM 0.32 names a
block by chaining its hash function (``prefix_caching_hash_algo``) over full blocks
of ``tokens_per_hash`` tokens from a per-process root (``NONE_HASH``), and an offload
key is the hash of a chunk's last block followed by its KV-cache group's index in 4
bytes (``make_offload_key``). The hash function and the root are set up by the
EngineCore after it built the scheduler (and so this tier), so they are resolved at
the first call, from the EngineCore object running in this process; until one is
found, no keys (the prefetch is refused, and the request pulls the ordinary way).

Only plain token prompts are keyed as the engine keys them: a prompt whose blocks need
extra keys (a ``cache_salt``, LoRA, multi-modal inputs) hashes differently, so its
prefetch asks the source for keys it does not hold; the fetch fails and nothing is
staged.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from vllm.v1.kv_offload.base import make_offload_key

from kvpeer.types import Key

__all__ = ["PromptKeys", "find_engine_core"]

log = logging.getLogger("kvpeer.vllm")


def find_engine_core(kind: type[Any] | None = None) -> Any:
    """The EngineCore (or ``kind``) object whose method runs on one of this process's
    threads now, or None. vLLM gives a tier no handle on its engine."""
    if kind is None:
        from vllm.v1.engine.core import EngineCore

        kind = EngineCore
    for top in sys._current_frames().values():
        frame: FrameType | None = top
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, kind):
                return owner
            frame = frame.f_back
    return None


class PromptKeys:
    """``keys(tokens)``: the offload keys of every full chunk of ``tokens``."""

    def __init__(self, offloading_spec: Any) -> None:
        config = offloading_spec.config
        self._tokens_per_hash = int(config.cache.tokens_per_hash)
        blocks_per_chunk = int(config.cache.blocks_per_chunk)
        #: (group index, hashes per chunk) of each KV-cache group
        self._groups = [
            (int(group.group_id), int(group.tokens_per_block) * blocks_per_chunk
             // self._tokens_per_hash)
            for group in config.groups
        ]  # fmt: skip
        self._hash: Callable[[Any], bytes] | None = None
        self._searched = 0

    def _hash_function(self) -> Callable[[Any], bytes] | None:
        if self._hash is None and self._searched < 100:
            self._searched += 1  # bounded: an in-process engine may never be found
            engine = find_engine_core()
            if engine is not None:
                from vllm.utils.hashing import get_hash_fn_by_name

                algo = engine.vllm_config.cache_config.prefix_caching_hash_algo
                self._hash = get_hash_fn_by_name(algo)
                log.info("kvpeer: prompts are keyed with %s for pulling ahead", algo)
        return self._hash

    def __call__(self, tokens: Sequence[int], max_keys: int) -> list[Key] | None:
        """The offload keys of ``tokens``' full chunks, hashing no more tokens than
        ``max_keys`` chunks of every group need."""
        hash_fn = self._hash_function()
        if hash_fn is None:
            return None
        from vllm.v1.core import kv_cache_utils

        root: bytes | None = getattr(kv_cache_utils, "NONE_HASH", None)
        if root is None:
            return None  # the engine has not set its root up yet
        size = self._tokens_per_hash
        per_chunk = max((per for _, per in self._groups), default=1)
        tokens = tokens[: max(0, max_keys) * max(1, per_chunk) * size]
        hashes: list[kv_cache_utils.BlockHash] = []
        parent: kv_cache_utils.BlockHash | None = None
        for start in range(0, len(tokens) - size + 1, size):
            parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[start : start + size])
            hashes.append(parent)
        keys: list[Key] = []
        for group, per_chunk in self._groups:
            if per_chunk <= 0:
                continue
            for end in range(per_chunk, len(hashes) + 1, per_chunk):
                keys.append(bytes(make_offload_key(hashes[end - 1], group)))
        return keys
