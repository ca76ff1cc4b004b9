"""``kvpeer bench trace --quick`` for real: a small generated trace in Mooncake's format
through two ``vllm serve`` engines behind the router, arms ``affinity`` and ``kvpeer``,
sent by vLLM's request function. Checked: every request answered, the engines reused
prompt tokens, each arm's numbers are there. No speed is asserted (a noisy machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow  # real engines, a few minutes

BENCH_TIMEOUT_S = 900


def small_trace(path: Path) -> Path:
    """Four conversations of three turns, each turn extending the last, 0.5 s apart."""
    rows = []
    for i in range(12):
        conversation, turn = divmod(i, 3)
        ids = [1000 * conversation + k for k in range(6 * (turn + 1))]
        rows.append({"timestamp": 500 * i, "input_length": len(ids) * 512 - 200,
                     "output_length": 64, "hash_ids": ids})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_quick_replay_through_two_engines(serve_llama: Path, tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "trace.jsonl")
    command = [sys.executable, "-m", "kvpeer", "bench", "trace", "--quick", "--json",
               "--trace", str(trace), "--arms", "affinity,kvpeer", "--window", "6",
               "--time-scale", "2", "--model", str(serve_llama),
               "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(done.stdout)
    assert result["ok"]
    assert result["requests"] == 12
    assert result["reusable_tokens"] > 0
    arms = {row["arm"]: row for row in result["arms"]}
    assert set(arms) == {"affinity", "kvpeer"}
    for row in arms.values():  # each arm's median over its turns (one here)
        assert (row["requests"], row["errors"], row["turns"]) == (12, 0, 1)
        assert row["ttft_p90_s"] >= row["ttft_p50_s"] > 0
        assert row["reuse_realised"] > 0
    turns = result["turns"]
    assert sorted(turn["arm"] for turn in turns) == ["affinity", "kvpeer"]
    for turn in turns:  # what each arm's turn did
        assert turn["reused_tokens"] > 0
        assert sum(turn["plans"].values()) == 12
        assert len(turn["per_request"]) == 12
