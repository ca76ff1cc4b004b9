"""A tiny random Llama checkpoint that vLLM loads from a local directory (no hub).

Weights are drawn with ``initializer_range=0.2`` so the model's outputs depend
strongly on its KV cache: corrupted KV gives different tokens, which is what makes
output equality a real test of moved KV bytes. The draw is seeded, so every engine
that loads the checkpoint computes the same outputs and the same block hashes.

``transformers`` and ``torch`` are imported only when a checkpoint must be written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["TINY_LLAMA_CONFIG", "ensure_tiny_llama"]

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,
}
# Keys transformers writes back verbatim; they identify the checkpoint on reuse
# (others, e.g. rope_theta, are rewritten into nested forms by newer versions).
_IDENTITY_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "initializer_range",
)
_SEED = 0
_WEIGHTS = "model.safetensors"
_CONFIG = "config.json"


def ensure_tiny_llama(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` holding the tiny Llama checkpoint, writing it only if needed.

    A directory that already holds a complete checkpoint of this configuration is
    reused as is. Otherwise the checkpoint is written to a temporary sibling and its
    files are moved in with ``os.replace``, weights first and ``config.json`` last,
    so a reader that finds a matching config finds the weights too, and concurrent
    callers each move in identical files.
    """
    target = Path(path)
    if _is_complete(target):
        return target
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_checkpoint(staging)
        names = sorted(entry.name for entry in staging.iterdir() if entry.name != _CONFIG)
        for name in [*names, _CONFIG]:
            os.replace(staging / name, target / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(path: Path) -> bool:
    """Whether ``path`` has weights and a config of :data:`TINY_LLAMA_CONFIG`'s shape."""
    weights = path / _WEIGHTS
    try:
        config = json.loads((path / _CONFIG).read_text(encoding="utf-8"))
        has_weights = weights.stat().st_size > 0
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or config.get("architectures") != ["LlamaForCausalLM"]:
        return False
    return has_weights and all(config.get(k) == TINY_LLAMA_CONFIG[k] for k in _IDENTITY_KEYS)


def _write_checkpoint(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # transformers' model constructors are untyped: the boundary is this one name.
    model_class: Any = LlamaForCausalLM
    torch.manual_seed(_SEED)
    model = model_class(LlamaConfig(**TINY_LLAMA_CONFIG))
    model.save_pretrained(directory, safe_serialization=True)
