"""``kvpeer demo`` as a user runs it: the real command, two ``vllm serve`` engines, the
router, the OpenAI client; its JSON, its progress and its exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpeer.lab.demo_run import BLOCK_TOKENS
from kvpeer.lab.engines.launcher import SHM_DIR

pytestmark = pytest.mark.slow  # real vllm serve engines

DEMO_TIMEOUT_S = 900
FIELDS = {
    "name",
    "outputs_match",
    "tokens_from_peer",
    "prompt_tokens",
    "bytes_from_peer",
    "blocks_from_peer",
    "data_plane",
    "ttft_local_s",
    "ttft_pulled_s",
    "load_seconds",
    "transfer_gbps",
    "max_logprob_delta",
    "problems",
    "api",
    "speedup",
    "source",
}


def serve_shm_files() -> set[Path]:
    return set(SHM_DIR.glob("*vllm_offload_kvpeer-serve-*"))


def test_demo_json_reports_every_scenario_pulled_from_the_peer_over_http(
    serve_llama: Path,
) -> None:
    shm_before = serve_shm_files()
    done = subprocess.run(
        [sys.executable, "-m", "kvpeer", "demo", "--json", "--model", str(serve_llama),
         "--prompt-tokens", "768"],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "starting two vllm serve engines" in done.stderr  # progress
    assert "routers: shared http://" in done.stderr

    result = json.loads(done.stdout)
    assert result["ok"] is True
    assert result["logs"] == []  # removed after a passing run
    scenarios = {s["name"]: s for s in result["scenarios"]}
    assert sorted(scenarios) == ["chat", "pd", "shared"]
    for s in scenarios.values():
        assert set(s) >= FIELDS
        assert s["api"] == "openai-http"
        assert s["outputs_match"] is True
        assert s["problems"] == []
        assert s["data_plane"] == "shm"
        assert s["source"] == "a"
        assert s["bytes_from_peer"] > 0
        assert s["bytes_from_peer"] % s["blocks_from_peer"] == 0
        assert s["ttft_local_s"] > 0
        assert s["ttft_pulled_s"] > 0
        assert s["speedup"] == pytest.approx(s["ttft_local_s"] / s["ttft_pulled_s"])
    for name in ("pd", "shared"):
        # every block of the prompt, the last one included (the router's held_tokens
        # names it too): the consumer computes only the prompt's last token
        assert scenarios[name]["blocks_from_peer"] == 768 // BLOCK_TOKENS, scenarios[name]
        assert scenarios[name]["tokens_from_peer"] == 768 - 1, scenarios[name]
    # The demo's engines run the README's tier entry (host and port only): the fast paths
    # are on by default. The producer holds copies of what it stored, and in shared mode
    # the router prefetches into the serving engine's tier, which obeys it (loopback).
    for s in scenarios.values():
        assert s["source_held_blocks"] > 0, s
    for name in ("shared", "chat"):
        assert scenarios[name]["prefetches"] >= 1, scenarios[name]
    assert scenarios["pd"]["prefetches"] == 0  # PD moves every block by its own fetch
    assert serve_shm_files() <= shm_before, "the demo left region files in /dev/shm"
