"""``kvpeer bench serve --quick`` for real: one arm pair (none, kvpeer) on ``pinned-chat``.

The command runs as a user runs it: two fresh ``vllm serve`` engines per arm behind the
real routers, the quick pinned-chat workload through the OpenAI API, ``--json`` out. Checked:
every request answered, kvpeer's arm pulled what the router named (no fallback, no failed
fetch) and reused more of the prompts than ``none``, the numbers and ratios are all there,
and nothing is left in ``/dev/shm``. No speed is asserted: this shared machine is noisy,
and speed claims come from the benchmark itself (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpeer.lab.bench.serve_bench import QUICK_SHAPE
from kvpeer.lab.engines.procs import shm_names

pytestmark = pytest.mark.slow  # real engines, ~3 minutes

BENCH_TIMEOUT_S = 900


def test_a_quick_none_kvpeer_pair_on_pinned_chat(serve_llama: Path, tmp_path: Path) -> None:
    shm_before = shm_names()
    command = [sys.executable, "-m", "kvpeer", "bench", "serve", "--quick", "--json",
               "--arms", "none,kvpeer", "--workloads", "pinned-chat", "--model", str(serve_llama),
               "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "arm kvpeer: starting engines a and b" in done.stderr  # progress on stderr
    result = json.loads(done.stdout)
    assert result["ok"]
    assert result["arms_not_run"] == []
    assert result["setup_errors"] == []
    cells = {cell["arm"]: cell for cell in result["cells"]}
    assert set(cells) == {"none", "kvpeer"}
    for cell in cells.values():
        assert cell["workload"] == "pinned-chat"
        assert (cell["requests"], cell["errors"]) == (QUICK_SHAPE.requests, 0)
        assert cell["ttft_p50_s"] > 0
        assert cell["ttft_p99_s"] >= cell["ttft_p50_s"]
        assert len(cell["per_request"]) == QUICK_SHAPE.requests
    none, kvpeer = cells["none"], cells["kvpeer"]
    assert none["pulled_tokens"] is None
    assert none["failed_fetches"] is None
    # kvpeer pulled every prefix the router named, and reused more than its own cache gave
    assert kvpeer["pulls_named"] >= 1
    assert kvpeer["pulls_fell_back"] == 0
    assert kvpeer["failed_fetches"] == 0
    assert kvpeer["pulled_tokens"] >= QUICK_SHAPE.prompt_tokens
    assert kvpeer["cached_tokens"] > none["cached_tokens"]
    for row in kvpeer["per_request"]:
        if row["source"] is not None:  # named: the turn before it, on the other engine
            assert row["cached_tokens"] >= QUICK_SHAPE.prompt_tokens, row
    (ratio,) = result["ratios"]
    assert (ratio["workload"], ratio["baseline"]) == ("pinned-chat", "none")
    assert ratio["ttft_p50"] > 0
    assert ratio["ttft_p99"] > 0
    assert shm_names() - shm_before == set()  # every engine's region files removed


def test_a_quick_unpinned_affinity_kvpeer_pair_on_chat(serve_llama: Path, tmp_path: Path) -> None:
    """The unpinned path for real: vLLM's request function sends the chat as text to
    routers with policy ``affinity`` and ``pull``; the engines' own prefix-cache counters
    and the routers' plans are read, at the two given loads."""
    command = [sys.executable, "-m", "kvpeer", "bench", "serve", "--quick", "--json",
               "--arms", "affinity,kvpeer,kvpeer-affinity", "--workloads", "chat",
               "--loads", "0.5,1.5",
               "--model", str(serve_llama), "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(done.stdout)
    assert result["ok"]
    assert result["loads"] == {"chat": [0.5, 1.5]}
    cells = {(cell["arm"], cell["workload"]): cell for cell in result["cells"]}
    arms = ("affinity", "kvpeer", "kvpeer-affinity")
    assert set(cells) == {(arm, f"chat@{level}") for arm in arms
                          for level in ("low", "high")}  # fmt: skip
    for (arm, _), cell in cells.items():
        assert (cell["requests"], cell["errors"]) == (QUICK_SHAPE.requests, 0)
        assert cell["offered_rate"] in (0.5, 1.5)
        assert all(row["engine"] in ("a", "b") for row in cell["per_request"])
        # later turns find their history: the engines count the reuse, the router planned
        # every request once
        assert cell["local_hit_tokens"] + cell["external_hit_tokens"] >= QUICK_SHAPE.prompt_tokens
        assert sum(cell["plans"].values()) == QUICK_SHAPE.requests
        assert (cell["pulls"] is None) == (arm == "affinity")
        assert cell["engine_cpu_s"] > 0
        if arm != "kvpeer":  # the tier-less router, and the same router over kvpeer tiers
            assert not {"pull", "pull: exploring", "compute: pull slower"} & set(cell["plans"])
        if arm == "kvpeer-affinity":  # the tier is there and never asked to pull
            assert cell["pulls"] == 0
            assert cell["pulls_named"] == 0
    assert {(r["workload"], r["arm"], r["baseline"]) for r in result["ratios"]} == {
        (f"chat@{level}", arm, "affinity") for level in ("low", "high")
        for arm in ("kvpeer", "kvpeer-affinity")}  # fmt: skip
