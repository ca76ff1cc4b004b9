"""While a fleet waits for engines to start, its running engines yield the CPU.

vLLM's p2p tier keeps its engine stepping while idle; on a 2-core machine a running
engine held a restarting peer's start past 180 s. These tests use plain processes in
their own groups instead of engines (fast), and read every thread's nice value from
``/proc`` as the scheduler sees it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpeer.lab.engines.serving import YIELD_NICE, ServeEngine, ServeFleet, ServeSpec

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="restoring a priority needs root; the fleet does not yield without"
)

# A process with a second thread, both sleeping: nice is per thread on Linux.
TWO_THREADS = (
    "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
    "time.sleep(60)"
)


def thread_nices(pid: int) -> list[int]:
    nices = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        nices.append(int(fields[16]))  # field 19 of stat, counted after the comm
    return nices


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[ServeFleet]:
    fleet = ServeFleet(tmp_path)
    yield fleet
    for engine in fleet.engines.values():
        engine.process.kill()
        engine.process.wait()


def add(fleet: ServeFleet, name: str, tmp_path: Path) -> ServeEngine:
    process = subprocess.Popen([sys.executable, "-c", TWO_THREADS], start_new_session=True)
    spec = ServeSpec(name=name, model=tmp_path)
    engine = ServeEngine(spec, process, tmp_path / f"{name}.log")
    fleet.engines[name] = engine
    while len(list(Path(f"/proc/{process.pid}/task").iterdir())) < 2:
        pass  # the second thread exists once python has run the line
    return engine


def test_running_engines_yield_while_another_starts_and_get_their_priority_back(
    fleet: ServeFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = add(fleet, "running", tmp_path)
    starting = add(fleet, "starting", tmp_path)
    seen: list[list[int]] = []
    groups: list[int | None] = []

    def healthy(engine: ServeEngine, timeout_s: float = 2.0) -> bool:
        if engine is running:
            return True
        seen.append(thread_nices(running.process.pid))
        groups.append(running.autogroup_nice())
        return len(seen) >= 2

    monkeypatch.setattr(ServeEngine, "healthy", healthy)
    monkeypatch.setattr("kvpeer.lab.engines.serving.POLL_S", 0.0)
    fleet.wait_ready(["starting"], timeout_s=30)
    assert seen == [[YIELD_NICE, YIELD_NICE]] * 2  # every thread, for the whole wait
    assert groups in ([YIELD_NICE] * 2, [None] * 2)  # None: this kernel has no autogroup
    assert thread_nices(running.process.pid) == [0, 0]
    assert running.autogroup_nice() in (0, None)
    assert thread_nices(starting.process.pid) == [0, 0]  # the one waited for never yields
    assert starting.autogroup_nice() in (0, None)


def test_priorities_come_back_when_the_wait_fails(
    fleet: ServeFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = add(fleet, "running", tmp_path)
    add(fleet, "starting", tmp_path)
    monkeypatch.setattr(ServeEngine, "healthy", lambda engine, timeout_s=2.0: engine is running)
    monkeypatch.setattr("kvpeer.lab.engines.serving.POLL_S", 0.0)
    with pytest.raises(Exception, match="not ready after 0 s"):
        fleet.wait_ready(["starting"], timeout_s=0.0)
    assert thread_nices(running.process.pid) == [0, 0]


def test_engines_that_start_together_yield_to_the_slower_once_ready(
    fleet: ServeFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = add(fleet, "fast", tmp_path)
    slow = add(fleet, "slow", tmp_path)
    calls = {"slow": 0}
    seen: list[list[int]] = []

    def healthy(engine: ServeEngine, timeout_s: float = 2.0) -> bool:
        if engine is fast:
            return True
        calls["slow"] += 1
        seen.append(thread_nices(fast.process.pid))
        return calls["slow"] >= 3

    monkeypatch.setattr(ServeEngine, "healthy", healthy)
    monkeypatch.setattr("kvpeer.lab.engines.serving.POLL_S", 0.0)
    fleet.wait_ready(["fast", "slow"], timeout_s=30)
    # The first round asks slow before fast is known ready; from the next on fast yields.
    assert seen[1:] == [[YIELD_NICE, YIELD_NICE]] * 2
    assert thread_nices(fast.process.pid) == [0, 0]
    assert thread_nices(slow.process.pid) == [0, 0]
