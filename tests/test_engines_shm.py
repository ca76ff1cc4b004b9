"""A fleet removes only /dev/shm files its own engines' processes used: never one that
merely appeared while an engine started (another program's, on a shared machine)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import uuid
from pathlib import Path

from kvpeer.lab.engines.procs import shm_in_use, shm_used_by
from kvpeer.lab.engines.serving import ServeEngine, ServeFleet, ServeSpec

SHM = Path("/dev/shm")


def test_a_semaphore_only_its_creator_maps_is_seen_in_use() -> None:
    """glibc creates a named semaphore under a temporary name and links it, so its
    creator's map names a deleted file: matched by name alone, a live semaphore looked
    unused and a fleet unlinked other engines' semaphores. Matched by inode, it is seen."""
    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem." + lock._semlock.name.lstrip("/")  # type: ignore[attr-defined]
    assert (SHM / name).exists()
    assert name in shm_in_use()
    assert name in shm_used_by([os.getpid()])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert name not in shm_used_by([child.pid])  # another process: not its user
    finally:
        child.kill()
        child.wait()


def test_an_engine_tracks_only_what_its_own_group_holds(tmp_path: Path) -> None:
    ours = f"psm_kvpeer-test-{uuid.uuid4().hex[:8]}"
    theirs = SHM / f"psm_kvpeer-test-{uuid.uuid4().hex[:8]}"
    holder = ("import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); "
              "print('ready', flush=True); time.sleep(120)")
    process = subprocess.Popen([sys.executable, "-c", holder, str(SHM / ours)],
                               stdout=subprocess.PIPE, start_new_session=True)
    fd = os.open(theirs, os.O_CREAT | os.O_RDWR, 0o600)  # another program's, alive
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == b"ready"
        engine = ServeEngine(ServeSpec("t", tmp_path), process, tmp_path / "t.log")
        engine.note_tracked()
        assert engine.tracked_files == {ours}
        assert ours in shm_used_by([process.pid])
        fleet = ServeFleet(tmp_path)
        fleet.engines["t"] = engine
        removed = fleet.close()  # stops the group, then removes what it left
        assert [path.name for path in removed] == [ours]
        assert theirs.exists()
    finally:
        os.close(fd)
        theirs.unlink(missing_ok=True)
        (SHM / ours).unlink(missing_ok=True)
        if process.poll() is None:
            process.kill()
