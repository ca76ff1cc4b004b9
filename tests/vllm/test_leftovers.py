"""Nothing left in /dev/shm after a ``vllm serve`` engine with the kvpeer tier exits
(issue 11, item 4), for real: one engine at a time (the tiny model).

Measured before the fix (vLLM 0.32): after SIGTERM the engine left its CPU region
``vllm_offload_<engine_id>.mmap`` (the API server SIGKILLs its EngineCore at once, so
vLLM's creator-side unlink never runs) and kvpeer's claim beside it; after SIGKILL of the
group, those two and Python's ``resource_tracker`` files (``psm_*`` message queues, a
``sem.mp-*`` semaphore). The tier now drops the region's name as soon as every process
has mapped it, so neither exit leaves a kvpeer file; a region and claim left by a process
that died during start-up are removed by the next engine that starts (its node sweeps);
the ``psm_``/``sem.mp-`` files of a killed group are vLLM's, and the fleet removes them.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpeer.host.claims import CLAIM_PREFIX
from kvpeer.lab.engines.serving import TRACKED_SHM_PREFIXES, ServeFleet, ServeSpec

pytestmark = pytest.mark.slow  # real vllm serve engines

SHM = Path("/dev/shm")


def ours(engine_id: str) -> list[str]:
    """Every /dev/shm name that carries ``engine_id`` (region files, claims)."""
    return sorted(name for name in os.listdir(SHM) if engine_id in name)


def serve_one(url: str) -> list[int]:
    body = {"model": "kvpeer-demo", "prompt": list(range(3, 200)), "max_tokens": 3,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer = json.loads(reply.read())
    tokens: list[int] = answer["choices"][0]["token_ids"]
    return tokens


def plant_dead_region() -> tuple[Path, Path]:
    """A region file and its claim as a tier killed during start-up leaves them: nobody
    holds the claim's lock."""
    region = SHM / f"vllm_offload_kvpeer-test-dead-{uuid.uuid4().hex[:8]}.mmap"
    claim = SHM / f"{CLAIM_PREFIX}{region.name}"
    region.write_bytes(b"\0" * 4096)
    claim.touch()
    return region, claim


def test_an_engine_leaves_nothing_after_sigterm_or_sigkill(
    tiny_llama: Path, tmp_path: Path
) -> None:
    fleet = ServeFleet(tmp_path / "logs")
    dead_region, dead_claim = plant_dead_region()
    try:
        term = ServeSpec("term", tiny_llama, max_model_len=512)
        fleet.start([term])
        swept = "the engine's node did not sweep a region whose claim nobody holds"
        assert not dead_region.exists(), swept
        assert not dead_claim.exists(), swept
        assert serve_one(term.url)
        engine = fleet.engines["term"]
        assert engine.tracked_files, "vLLM made no psm_/sem.mp- file? the probe is stale"
        assert ours(term.engine_id) == [], "region name or claim kept while serving"

        engine.stop()  # SIGTERM to the API server: vLLM's own clean shutdown
        assert engine.process.returncode == 0
        assert ours(term.engine_id) == [], "files left after SIGTERM"
        assert not {n for n in os.listdir(SHM) if n in engine.tracked_files}, (
            "vLLM's resource_tracker files left after a clean exit"
        )

        kill = ServeSpec("kill", tiny_llama, max_model_len=512)
        fleet.start([kill])
        assert serve_one(kill.url)
        engine = fleet.engines["kill"]
        engine.signal(signal.SIGKILL)
        assert engine.wait_gone()
        assert ours(kill.engine_id) == [], "kvpeer's files left after SIGKILL"
        tracked = {n for n in os.listdir(SHM) if n.startswith(TRACKED_SHM_PREFIXES)}
        left_by_vllm = engine.tracked_files & tracked
    finally:
        removed = {path.name for path in fleet.close()}
        for path in (dead_region, dead_claim):
            path.unlink(missing_ok=True)
    # What a SIGKILLed group leaves is vLLM's (resource_tracker died with it); the fleet
    # removes exactly those, and nothing of it stays.
    assert left_by_vllm <= removed
    assert not left_by_vllm & set(os.listdir(SHM))
