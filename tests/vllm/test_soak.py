"""``kvpeer soak`` for real, short: two ``vllm serve`` engines behind the routers, traffic,
a freeze of each engine and at least one SIGKILL + restart of ``b`` (seed 5, a fault every
~6 s),
then the verdict: every output equals its reference, the processes alive throughout
stayed within 5 %, nothing is left in /dev/shm. About 5-6 minutes here (an engine restart
under load takes 1-2 of them; the warm-up restarts ``b`` once too)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpeer.lab.bench.soak_run import run
from kvpeer.lab.bench.soak_verdict import SoakSpec, render

pytestmark = pytest.mark.slow  # real vllm serve engines


def test_a_short_soak_passes_every_check(serve_llama: Path, tmp_path: Path) -> None:
    result = run(SoakSpec(minutes=1.0, fault_every_s=6.0, seed=5), serve_llama, tmp_path, print)
    text = render(result)
    assert result["ok"], text
    assert result["faults"].get("freeze", 0) >= 1, text
    # How many faults fit in the minute depends on how fast a restart comes up (engines
    # yield the CPU to a restarting one since 2026-12-02: two kill-restarts in 20 s each).
    assert result["faults"].get("kill-restart", 0) >= 1, text
    assert result["mismatches"] == 0
    assert result["leftovers"] == []
    judged = [row for row in result["processes"] if row["judged"]]
    # The routers run as kvpeer router processes and are judged; the driver generates load.
    assert {row["label"].split(":")[0] for row in judged} == {"router-shared", "router-pd", "a"}
    assert any(k.endswith(" GPU") for k in result["router_index"]["shared"]["after"]), text
    served = sum(n for kind in result["requests"].values() for c, n in kind.items()
                 if c in ("ok", "fallback"))  # fmt: skip
    assert served > 0
