"""``--model DIR``: kvpeer writes its random Llama only where it cannot destroy a model.

Every command that runs engines (demo, soak, bench serve, bench faults) takes a
checkpoint directory and writes kvpeer's random Llama there when it is missing or of
another shape. A directory holding somebody's own model must never be overwritten:
the command stops with an error naming the directory and what is in it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpeer.errors import ConfigError
from kvpeer.lab.engines.model import TINY_LLAMA_CONFIG, ensure_tiny_llama


def foreign_model(path: Path) -> dict[str, bytes]:
    """A directory shaped like a downloaded Hugging Face model; returns its files' bytes."""
    path.mkdir()
    files = {
        "config.json": json.dumps(
            {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000}
        ).encode(),
        "model-00001-of-00002.safetensors": b"somebody's weights",
        "tokenizer.json": b"{}",
    }
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def contents(path: Path) -> dict[str, bytes]:
    return {entry.name: entry.read_bytes() for entry in path.iterdir()}


def test_a_model_kvpeer_did_not_write_is_never_overwritten(tmp_path: Path) -> None:
    model = tmp_path / "llama-3"
    before = foreign_model(model)

    with pytest.raises(ConfigError) as raised:
        ensure_tiny_llama(model)

    message = str(raised.value)
    assert str(model) in message
    assert "model-00001-of-00002.safetensors" in message
    assert "vocab_size 32000" in message
    assert contents(model) == before
    assert not [entry for entry in tmp_path.iterdir() if entry.name != "llama-3"]


def test_a_file_is_not_a_model_directory(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.write_text("not a directory")
    with pytest.raises(ConfigError, match="not a directory"):
        ensure_tiny_llama(target)
    assert target.read_text() == "not a directory"


@pytest.mark.parametrize("marked", [True, False], ids=["marker", "before-the-marker"])
def test_a_checkpoint_kvpeer_wrote_is_rewritten_to_the_asked_shape(
    tmp_path: Path, marked: bool
) -> None:
    # A kvpeer checkpoint of another shape: recognised by the marker, or (written by an
    # older kvpeer) by its random Llama's vocabulary and initializer range.
    model = tmp_path / "model"
    model.mkdir()
    config = {**TINY_LLAMA_CONFIG, "architectures": ["LlamaForCausalLM"], "hidden_size": 96}
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"stale weights")
    if marked:
        (model / ".kvpeer-random-llama").write_text("{}")

    assert ensure_tiny_llama(model) == model

    written = json.loads((model / "config.json").read_text())
    assert written["hidden_size"] == TINY_LLAMA_CONFIG["hidden_size"]
    assert (model / "model.safetensors").read_bytes() != b"stale weights"
    marker = json.loads((model / ".kvpeer-random-llama").read_text())
    assert marker["hidden_size"] == TINY_LLAMA_CONFIG["hidden_size"]


def test_the_command_names_the_directory_and_stops(tmp_path: Path) -> None:
    model = tmp_path / "llama-3"
    before = foreign_model(model)

    done = subprocess.run(
        [sys.executable, "-m", "kvpeer", "soak", "--minutes", "1", "--model", str(model)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 2, done.stderr
    assert f"kvpeer: model directory {model}: holds a model kvpeer did not write" in done.stderr
    assert "Traceback" not in done.stderr
    assert contents(model) == before
