"""The intake replay tool: a recorded fleet replays through either kind of loop, and the
same events count the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpeer.lab.bench import intake_replay
from kvpeer.router.index import PrefixIndex

TOOL = Path(intake_replay.__file__)


def test_a_recorded_fleet_replays_through_both_loops(tmp_path: Path) -> None:
    out = tmp_path / "fleet.pkl"
    made = intake_replay.record(2, out, seconds=0.2)
    assert made["engines"] == 2
    assert out.stat().st_size > 0
    kinds = ("c", "python") if PrefixIndex().native else ("python",)
    results = [intake_replay.replay(out, kind) for kind in kinds]
    assert {r["events"] for r in results} == {results[0]["events"]}
    assert results[0]["events"] > 0
    assert [r["loops"] for r in results] == [{"c": "C", "python": "Python"}[k] for k in kinds]
    assert all(r["cores_needed"] > 0 for r in results)


def test_run_as_a_file_it_names_a_missing_recording(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pkl"
    done = subprocess.run([sys.executable, str(TOOL), "replay", str(missing)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert f"no recording at {missing}" in done.stderr
    done = subprocess.run([sys.executable, str(TOOL), "record", "0", str(missing)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "engines must be positive" in done.stderr


@pytest.mark.parametrize("loops", ["python"])
def test_the_json_line_is_one_object(tmp_path: Path, loops: str) -> None:
    out = tmp_path / "fleet.pkl"
    intake_replay.record(1, out, seconds=0.1)
    done = subprocess.run([sys.executable, str(TOOL), "replay", str(out), "--loops", loops,
                           "--json"], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout)
    assert result["loops"] == "Python"
    assert result["engines"] == 1
