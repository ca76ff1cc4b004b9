"""Region files of processes that died are removed by the next node (kvpeer.host.claims)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvpeer.host import BlockPool
from kvpeer.host.claims import CLAIM_PREFIX, Claim, sweep

CLAIMER = """
import sys, time
from kvpeer.host.claims import Claim
path = sys.argv[1]
open(path, "wb").write(b"region")
claim = Claim(path)
print("claimed", flush=True)
time.sleep(60)
"""


def _claimed_by_a_child(path: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "claimed"
    return child


def test_the_file_of_a_killed_process_is_swept(tmp_path: Path) -> None:
    region = tmp_path / "kvpeer-serve-1234-5710"
    child = _claimed_by_a_child(region)
    try:
        assert sweep(str(tmp_path)) == []  # alive: untouched
        assert region.exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert sweep(str(tmp_path)) == [str(region)]
    assert sorted(os.listdir(tmp_path)) == []


def test_files_nobody_claimed_are_never_touched(tmp_path: Path) -> None:
    other = tmp_path / "someone-elses-file"
    other.write_bytes(b"x")
    (tmp_path / "vllm_offload_abc.mmap").write_bytes(b"x")
    assert sweep(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == ["someone-elses-file", "vllm_offload_abc.mmap"]


def test_a_file_two_processes_claim_stays_until_both_are_gone(tmp_path: Path) -> None:
    region = tmp_path / "shared-region"
    region.write_bytes(b"x")
    first, second = Claim(str(region)), Claim(str(region))
    first.release()
    assert sweep(str(tmp_path)) == []
    assert region.exists()
    second.release(remove_claim=False)  # unlocked but left: as after a crash
    assert sweep(str(tmp_path)) == [str(region)]
    assert not (tmp_path / f"{CLAIM_PREFIX}shared-region").exists()


def test_a_claim_of_a_process_killed_before_its_rename_is_cleaned(tmp_path: Path) -> None:
    staging = tmp_path / f".{CLAIM_PREFIX}999-abc"
    staging.write_bytes(b"")
    assert sweep(str(tmp_path)) == []
    assert not staging.exists()


def test_a_pool_claims_its_file_and_removes_both_at_close() -> None:
    path = f"/dev/shm/kvpeer-test-claims-{os.getpid()}"
    claim = f"/dev/shm/{CLAIM_PREFIX}kvpeer-test-claims-{os.getpid()}"
    pool = BlockPool(2, 4096, shm_path=path)
    try:
        assert os.path.exists(claim)
        sweep()
        assert os.path.exists(path), "the sweep removed a live pool's file"
    finally:
        pool.close()
    assert not os.path.exists(path)
    assert not os.path.exists(claim)
