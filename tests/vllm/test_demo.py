"""``kvpeer demo`` as a user runs it: the real command, real engines, its JSON and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpeer.demo import BLOCK_TOKENS
from kvpeer.integrations.vllm.launcher import SHM_DIR

DEMO_TIMEOUT_S = 900
FIELDS = {
    "name",
    "outputs_match",
    "tokens_from_peer",
    "prompt_tokens",
    "bytes_from_peer",
    "data_plane",
    "ttft_local_s",
    "ttft_pulled_s",
}


def demo_shm_files() -> set[Path]:
    return set(SHM_DIR.glob("vllm_offload_kvpeer-demo-*"))


def test_demo_json_reports_both_scenarios_pulled_from_the_peer(
    tiny_llama: Path, tmp_path: Path
) -> None:
    shm_before = demo_shm_files()
    done = subprocess.run(
        [sys.executable, "-m", "kvpeer", "demo", "--json", "--model", str(tiny_llama)],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "starting engine A (producer) and engine B (consumer)" in done.stderr  # progress

    result = json.loads(done.stdout)
    assert result["ok"] is True
    assert result["logs"] == []  # removed after a passing run
    scenarios = {s["name"]: s for s in result["scenarios"]}
    assert sorted(scenarios) == ["pd", "symmetric"]
    for s in scenarios.values():
        assert set(s) >= FIELDS
        assert s["outputs_match"] is True
        assert s["problems"] == []
        assert s["data_plane"] == "shm"
        assert s["tokens_from_peer"] >= s["prompt_tokens"] - BLOCK_TOKENS
        assert s["bytes_from_peer"] > 0
        assert s["bytes_from_peer"] % s["blocks_from_peer"] == 0
        assert s["ttft_local_s"] > 0
        assert s["ttft_pulled_s"] > 0
    assert demo_shm_files() <= shm_before, "the demo left primary-region files in /dev/shm"
