"""``kvpeer bench idle --quick --json`` for real: idle engines with kvpeer's tier and vLLM's.

One run of the command (two multiprocessing engines started together, ~2 minutes on a
busy 2-core machine) feeds every check: an idle engine with kvpeer's tier sleeps while
one with vLLM's ``p2p`` tier keeps stepping, and the sleeping kvpeer producer still
answers every lookup (kvpeer wakes it), as does vLLM's. The measured numbers are
printed (``pytest -s``) and recorded as junit properties.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvpeer.lab.bench.idle import KVPEER_TCP, LOOKUP_TIMEOUT_S, VLLM_P2P
from kvpeer.lab.engines.launcher import SHM_DIR
from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend

pytestmark = [  # real engines, ~2 minutes
    pytest.mark.slow,
    pytest.mark.skipif(not NixlBackend.available(), reason=INSTALL_HINT),
]

BENCH_TIMEOUT_S = 900
ENGINE_CORE = "VLLM::EngineCor"
# A sleeping EngineCore uses ~0.01 of a core (kvpeer's driver thread); a stepping one
# a core, and still a good part of one when a busy machine shares it out.
MAX_SLEEPING_ENGINE_CORE_CORES = 0.1
MIN_SPINNING_ENGINE_CORES = 0.25
MIN_SPIN_RATIO = 10.0  # vLLM-p2p's idle engine uses at least this many times kvpeer's
ROLES = {"main", "engine_core", "worker"}

RecordProperty = Callable[[str, object], None]


def idle_shm_files() -> set[Path]:
    return set(SHM_DIR.glob("vllm_offload_kvpeer-idle-*"))


@pytest.fixture(scope="module")
def result(tiny_llama: Path) -> dict[str, Any]:
    shm_before = idle_shm_files()
    command = ["bench", "idle", "--quick", "--json", "--model", str(tiny_llama)]
    done = subprocess.run(
        [sys.executable, "-m", "kvpeer", *command],
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "starting 2 engines together" in done.stderr  # progress while engines start
    assert idle_shm_files() <= shm_before, "the bench left primary-region files in /dev/shm"
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def idle_row(result: dict[str, Any], engine: str) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {row["engine"]: row for row in result["idle"]}
    return rows[engine]


def lookup_row(result: dict[str, Any], producer: str) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {row["producer"]: row for row in result["lookups"]}
    return rows[producer]


def report(record_property: RecordProperty, name: str, value: float) -> None:
    record_property(name, value)
    print(f"{name}: {value}")


def test_result_has_one_row_per_engine_and_producer(result: dict[str, Any]) -> None:
    assert result["spec"] == "quick"
    assert [row["engine"] for row in result["idle"]] == [VLLM_P2P, KVPEER_TCP]
    for row in result["idle"]:
        assert set(row["cores_by_role"]) == ROLES
        assert ENGINE_CORE in row["cpu_seconds_by_process"]
        assert row["seconds"] >= result["idle_s"]
    assert [(r["producer"], r["consumer_plane"]) for r in result["lookups"]] == [
        (VLLM_P2P, "nixl"),
        (KVPEER_TCP, "tcp"),
    ]
    assert set(result["compare"]) >= {"idle_cores_vs_vllm_p2p", "lookup_median_vs_vllm_p2p"}


def test_idle_kvpeer_engine_sleeps_while_the_vllm_p2p_one_spins(
    result: dict[str, Any], record_property: RecordProperty
) -> None:
    kvpeer, p2p = idle_row(result, KVPEER_TCP), idle_row(result, VLLM_P2P)
    for name, row in (("kvpeer_tcp", kvpeer), ("vllm_p2p", p2p)):
        report(record_property, f"idle_{name}_cores", row["cores"])
        report(
            record_property, f"idle_{name}_engine_core_cores", row["cores_by_role"]["engine_core"]
        )

    assert kvpeer["cores_by_role"]["engine_core"] < MAX_SLEEPING_ENGINE_CORE_CORES, kvpeer
    assert p2p["cores"] > MIN_SPINNING_ENGINE_CORES, p2p
    assert p2p["cores"] > MIN_SPIN_RATIO * kvpeer["cores"], (p2p, kvpeer)


def test_idle_kvpeer_producer_answers_every_lookup(
    result: dict[str, Any], record_property: RecordProperty
) -> None:
    kvpeer = lookup_row(result, KVPEER_TCP)
    report(record_property, "lookup_kvpeer_tcp_median_ms", kvpeer["median_ms"])
    report(record_property, "lookup_kvpeer_tcp_max_ms", kvpeer["max_ms"])

    assert kvpeer["lookups"] > 0
    assert kvpeer["timeouts"] == 0, kvpeer
    assert kvpeer["answered"] == kvpeer["lookups"]
    assert kvpeer["hits"] == [kvpeer["keys"]] * kvpeer["lookups"], "keys it holds came back MISS"
    assert kvpeer["max_ms"] < LOOKUP_TIMEOUT_S * 1e3


def test_vllm_p2p_producer_answers_the_kvpeer_consumer(
    result: dict[str, Any], record_property: RecordProperty
) -> None:
    """The comparison row is real: vLLM's tier answered kvpeer's lookups over NIXL."""
    p2p = lookup_row(result, VLLM_P2P)
    if p2p["median_ms"] is not None:
        report(record_property, "lookup_vllm_p2p_median_ms", p2p["median_ms"])

    assert p2p["answered"] >= 1, p2p
    assert max(p2p["hits"]) == p2p["keys"], p2p
