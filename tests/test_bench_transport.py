"""``kvpeer bench transport`` as a user runs it: real producer process, real baselines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpeer.lab.bench.transport import render

KIB = 1024
MIB = 1024 * KIB


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpeer", "bench", "transport", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow  # a real benchmark run, ~20 s
def test_quick_json_run_over_shm_reports_every_row_against_its_baseline() -> None:
    run = _bench("--quick", "--planes", "shm", "--json")

    assert run.returncode == 0, run.stderr
    assert "shm: 64 KiB blocks" in run.stderr  # progress, on stderr
    result = json.loads(run.stdout)
    rows = result["results"]
    assert {(r["block_len"], r["blocks"]) for r in rows} == {
        (64 * KIB, 1),
        (64 * KIB, 64),
        (1024 * KIB, 1),
        (1024 * KIB, 64),
    }
    for row in rows:
        assert row["transport"] == "shm"
        assert row["baseline"] == "memcpy"
        assert row["gbps"] > 0
        assert row["baseline_gbps"] > 0
        assert abs(row["ratio"] - row["gbps"] / row["baseline_gbps"]) < 0.01
        if row["blocks"] == 1:
            assert row["rtt_us"] > 0
            assert row["rtt_target_us"] > 3 * row["zmq_rtt_us"]
        else:
            assert "rtt_us" not in row
    assert result["zmq_rtt_us"] > 0
    assert "shm" in render(result)


def test_an_unknown_plane_is_named_and_exits_2() -> None:
    run = _bench("--quick", "--planes", "shm,carrier-pigeon")

    assert run.returncode == 2
    assert "carrier-pigeon" in run.stderr
    assert run.stdout == ""


def test_render_shows_the_ratio_and_the_one_block_target() -> None:
    result = {
        "zmq_rtt_us": 60.0,
        "results": [
            {"transport": "tcp", "block_len": 64 * KIB, "blocks": 1, "gbps": 0.5,
             "baseline": "raw_socket", "baseline_gbps": 2.0, "ratio": 0.25,
             "rtt_us": 400.0, "zmq_rtt_us": 60.0, "rtt_target_us": 187.0},
            {"transport": "nixl", "block_len": MIB, "blocks": 64, "gbps": 3.0,
             "baseline": "raw_nixl", "baseline_gbps": None, "ratio": None},
        ],
    }  # fmt: skip

    lines = render(result).splitlines()

    assert "60 us" in lines[0]
    assert lines[2].split()[:3] == ["tcp", "64Ki", "1"]
    assert "0.25" in lines[2]
    assert "400 (187)" in lines[2]
    assert lines[3].split()[-2:] == ["n/a", "n/a"]
