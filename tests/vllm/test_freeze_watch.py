"""The interop test's freeze detector sees a stretch in which its process did not run."""

from __future__ import annotations

import os
import subprocess
import time

from kvpeer.lab.engines.runner import FreezeWatch


def test_a_stopped_process_is_seen_frozen() -> None:
    with FreezeWatch() as stopped:
        time.sleep(0.1)  # the watch is ticking
        # Stops this whole process (every thread) for 0.6 s, as a paused machine would.
        subprocess.run(
            ["sh", "-c", f"kill -STOP {os.getpid()}; sleep 0.6; kill -CONT {os.getpid()}"],
            check=True,
        )
        time.sleep(0.1)
    assert stopped.longest_s >= 0.5
