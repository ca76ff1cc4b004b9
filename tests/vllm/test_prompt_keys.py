"""Pulling ahead hashes a router's tokens into the keys the scheduler will look up:
``PromptKeys`` against vLLM's own request block hasher and offload-key packing, for one
block per chunk and for several, and only as many tokens as the keys asked for."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request

from kvpeer.integrations.vllm.prompt_keys import PromptKeys

BLOCK = 16


def spec(blocks_per_chunk: int) -> Any:
    group = SimpleNamespace(group_id=0, tokens_per_block=BLOCK)
    cache = SimpleNamespace(tokens_per_hash=BLOCK, blocks_per_chunk=blocks_per_chunk)
    return SimpleNamespace(config=SimpleNamespace(cache=cache, groups=(group,)))


def schedulers_keys(tokens: list[int], blocks_per_chunk: int) -> list[bytes]:
    """What vLLM's scheduler computes: the request's block hashes, then each chunk's
    last block hash with its group index."""
    fn = get_hash_fn_by_name("sha256")
    request = Request("r", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=kv_cache_utils.get_request_block_hasher(BLOCK, fn))  # fmt: skip
    hashes = request.block_hashes
    return [
        bytes(make_offload_key(hashes[end - 1], 0))
        for end in range(blocks_per_chunk, len(hashes) + 1, blocks_per_chunk)
    ]


@pytest.fixture
def sha256_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's hash set up as an EngineCore does (its algorithm and root)."""
    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    monkeypatch.setattr(PromptKeys, "_hash_function", lambda self: fn)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_keys_are_the_schedulers(sha256_engine: None, blocks_per_chunk: int) -> None:
    tokens = [(i * 7919) % 32000 for i in range(10 * BLOCK + 5)]  # a partial block at the end
    keys = PromptKeys(spec(blocks_per_chunk))(tokens, 1000)
    assert keys == schedulers_keys(tokens, blocks_per_chunk)
    assert len(keys) == 10 // blocks_per_chunk


def test_no_more_tokens_are_hashed_than_the_keys_asked_for(sha256_engine: None) -> None:
    tokens = list(range(40 * BLOCK))
    keys = PromptKeys(spec(1))(tokens, 3)
    assert keys == schedulers_keys(tokens, 1)[:3]


def test_no_keys_before_an_engine_is_found() -> None:
    assert PromptKeys(spec(1))(list(range(4 * BLOCK)), 10) is None  # no EngineCore here
