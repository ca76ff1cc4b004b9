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


def test_a_semaphores_creator_does_not_map_it_by_its_name() -> None:
    """Why "no living process uses it" cannot tell a leftover semaphore: glibc creates a
    named semaphore under a temporary name and links it, so its creator's map shows the
    temporary file; a fleet that trusted it unlinked other engines' live semaphores."""
    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem." + lock._semlock.name.lstrip("/")  # type: ignore[attr-defined]
    assert (SHM / name).exists()
    assert name not in shm_in_use()
    assert name not in shm_used_by([os.getpid()])


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
