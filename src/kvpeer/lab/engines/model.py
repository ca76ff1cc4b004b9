"""Random Llama checkpoints that vLLM loads from a local directory (no hub).

Two shapes: :data:`TINY_LLAMA_CONFIG` (the tests' engines: fast to load and run) and
:data:`SERVE_LLAMA_CONFIG` (the serving demo's: big enough that a long prompt takes
a noticeable time to prefill on a CPU, which is what pulling KV saves).

Weights are drawn with ``initializer_range=0.2`` so the model's outputs depend
strongly on its KV cache: corrupted KV gives different tokens, which is what makes
output equality a real test of moved KV bytes. The draw is seeded, so every engine
that loads the checkpoint computes the same outputs and the same block hashes.

Each checkpoint carries a word-level tokenizer whose words are ``t<id>`` (``"t5 t9"``
is ``[5, 9]``, no special tokens added) and a chat template that concatenates the
messages' contents, so an OpenAI server (``vllm serve``) can take text prompts,
chat requests and ``/tokenize`` calls, and a text prompt and its token ids are one
and the same request. ``transformers`` and ``torch`` are imported only when a
checkpoint must be written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvpeer.errors import ConfigError

__all__ = [
    "SERVE_LLAMA_CONFIG",
    "TINY_LLAMA_CONFIG",
    "ensure_llama",
    "ensure_tiny_llama",
    "token_text",
    "write_tokenizer",
]

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
# The serving demo's model: a 1,024-token prompt takes about a second to prefill here.
SERVE_LLAMA_CONFIG: dict[str, Any] = {
    **TINY_LLAMA_CONFIG,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 2048,
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
_TOKENIZER = "tokenizer.json"
# Written beside every checkpoint kvpeer makes: only such a directory is ever rewritten.
_MARKER = ".kvpeer-random-llama"
# Files that hold a model's weights: a directory with one that kvpeer did not write is
# someone's model, never overwritten.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The chat template: the messages' contents, one after the other. A conversation's next
# turn therefore extends the previous turn's prompt, as a real template's would.
_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def token_text(tokens: list[int]) -> str:
    """The text whose tokenization is exactly ``tokens`` (ids past the special tokens)."""
    return " ".join(f"t{token}" for token in tokens)


def ensure_tiny_llama(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` holding the tiny Llama checkpoint, writing it only if needed."""
    return ensure_llama(path, TINY_LLAMA_CONFIG)


def ensure_llama(path: str | os.PathLike[str], config: dict[str, Any]) -> Path:
    """Return ``path`` holding a random Llama of ``config``, writing it only if needed.

    A directory that already holds a complete checkpoint of this configuration is
    reused as is. Otherwise the checkpoint is written to a temporary sibling and its
    files are moved in with ``os.replace``, weights first and ``config.json`` last,
    so a reader that finds a matching config finds the weights too, and concurrent
    callers each move in identical files.
    """
    target = Path(path)
    if _is_complete(target, config):
        return target
    _refuse_foreign(target)
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_checkpoint(staging, config)
        names = sorted(entry.name for entry in staging.iterdir() if entry.name != _CONFIG)
        for name in [*names, _CONFIG]:
            os.replace(staging / name, target / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(path: Path, expected: dict[str, Any]) -> bool:
    """Whether ``path`` has weights, a tokenizer and a config of ``expected``'s shape."""
    weights = path / _WEIGHTS
    try:
        config = json.loads((path / _CONFIG).read_text(encoding="utf-8"))
        has_weights = weights.stat().st_size > 0 and (path / _TOKENIZER).stat().st_size > 0
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or config.get("architectures") != ["LlamaForCausalLM"]:
        return False
    return has_weights and all(config.get(k) == expected[k] for k in _IDENTITY_KEYS)


def _refuse_foreign(path: Path) -> None:
    """Raise :class:`ConfigError` unless ``path`` may be (re)written with a random Llama.

    It may if it does not exist, holds no weights, holds kvpeer's marker, or its config
    is one of kvpeer's random Llamas (checkpoints written before the marker). Anything
    else is a model someone else made: kvpeer's commands never overwrite it.
    """
    if path.exists() and not path.is_dir():
        raise ConfigError(f"model directory {path}: exists and is not a directory")
    if not path.is_dir() or (path / _MARKER).exists():
        return
    weights = sorted(e.name for e in path.iterdir() if e.name.endswith(_WEIGHT_SUFFIXES))
    if not weights:
        return
    try:
        config = json.loads((path / _CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and all(
        config.get(key) == TINY_LLAMA_CONFIG[key] for key in ("vocab_size", "initializer_range")
    ):
        return
    shape = ""
    if isinstance(config, dict):
        kind = config.get("model_type", "unknown type")
        shape = f" ({kind}, vocab_size {config.get('vocab_size')})"
    raise ConfigError(
        f"model directory {path}: holds a model kvpeer did not write ({weights[0]}{shape}); "
        "kvpeer runs its own random Llama and writes it only into a new or empty directory "
        "or one it wrote before: pass another --model directory"
    )


def _write_checkpoint(directory: Path, config: dict[str, Any]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # transformers' model constructors are untyped: the boundary is this one name.
    model_class: Any = LlamaForCausalLM
    torch.manual_seed(_SEED)
    model = model_class(LlamaConfig(**config))
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory, int(config["vocab_size"]))
    identity = {key: config[key] for key in _IDENTITY_KEYS}
    (directory / _MARKER).write_text(json.dumps(identity, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer: word ``t<id>`` is token ``id``; nothing else is added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {name: index for index, name in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{index}": index for index in range(len(SPECIAL_TOKENS), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # transformers' tokenizer classes are untyped: the boundary is this one name.
    tokenizer_class: Any = PreTrainedTokenizerFast
    tokenizer = tokenizer_class(
        tokenizer_object=core,
        unk_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        chat_template=_CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(directory)
