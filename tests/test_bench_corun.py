"""``kvpeer bench corun`` without an engine: its arithmetic, its hogs, its bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpeer.lab.bench import corun


def test_ratios_are_medians_of_per_turn_ratios() -> None:
    kernels = {
        "bandwidth": [{"alone_s": 1.0, "pair_s": [2.0, 1.8]},
                      {"alone_s": 0.5, "pair_s": [1.0, 1.0]},
                      {"alone_s": 1.0, "pair_s": [1.0, 1.0]}],
        "compute": [{"alone_s": 1.0, "pair_s": [1.0, 1.1]}],
    }  # fmt: skip
    prefill = [
        {"alone_s": 1.0, "bandwidth_s": 1.5, "compute_s": 1.0},
        {"alone_s": 2.0, "bandwidth_s": 4.0, "compute_s": 2.2},
        {"alone_s": 1.0, "bandwidth_s": 1.8, "compute_s": 0.9},
    ]
    result = corun.summarize(corun.CorunSpec(turns=3), kernels, prefill, 0.5)
    assert result["kernel_pair_over_alone"] == pytest.approx({"bandwidth": 1.9, "compute": 1.05})
    ratios = result["prefill_with_hog_over_alone"]
    assert (ratios["bandwidth"], ratios["compute"]) == pytest.approx((1.8, 1.0))
    assert ratios["engine"] is None  # no turn ran it
    assert result["prefill_alone_s"] == 1.0
    text = corun.render(result)
    assert "| 1.90x | 1.05x |" in text
    assert "| 1.80x | 1.00x |" in text


def test_no_kernel_turns_render_as_a_dash() -> None:
    prefill = [{"alone_s": 1.0, "bandwidth_s": 2.0, "compute_s": 1.0}]
    result = corun.summarize(corun.CorunSpec(turns=1), {"bandwidth": [], "compute": []},
                             prefill, 0.1)  # fmt: skip
    assert result["kernel_pair_over_alone"] == {"bandwidth": None, "compute": None}
    assert "| - | - |" in corun.render(result)


@pytest.mark.parametrize(
    ("turns", "tokens", "named"),
    [(0, 2016, "turns 0"), (51, 2016, "turns 51"), (2, 8, "prompt tokens 8"),
     (2, 4096, "prompt tokens 4096")],
)  # fmt: skip
def test_bad_values_are_named(turns: int, tokens: int, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        corun.CorunSpec(turns=turns, prompt_tokens=tokens)


def test_the_command_names_a_bad_value_and_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "kvpeer", "bench", "corun", "--turns", "0"],
                          check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "turns 0: must be 1..50" in done.stderr


def test_a_hog_runs_until_stopped_and_reports_its_rate() -> None:
    pytest.importorskip("torch")
    for kind in corun.HOGS:
        hog = corun.Hog(kind)
        try:
            assert hog.stop() > 0.0
        finally:
            hog.kill()
    with pytest.raises(ValueError, match="'disk'"):
        corun.Hog("disk")


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_a_kernel_pair_runs_once_on_each_cpu() -> None:
    pytest.importorskip("torch")
    seconds = corun.kernel_turn("compute", 3, [0, 1])
    assert len(seconds) == 2
    assert all(s > 0.0 for s in seconds)


def test_the_co_run_arm_and_the_cores_by_role() -> None:
    cores = {"worker": 1.0, "engine_core": 0.1}
    prefill = [
        {"alone_s": 1.0, "bandwidth_s": 1.2, "compute_s": 1.0, "engine_s": 2.0,
         "engine_later_s": 2.2,
         "alone_cores": cores, "engine_cores": {"worker": 1.5, "engine_core": 0.3}},
        {"alone_s": 1.0, "bandwidth_s": 1.3, "compute_s": 1.1, "engine_s": 1.8,
         "engine_later_s": 2.0,
         "alone_cores": cores, "engine_cores": {"worker": 1.7, "engine_core": 0.1}},
    ]  # fmt: skip
    result = corun.summarize(corun.CorunSpec(turns=2), {"bandwidth": [], "compute": []},
                             prefill, 1.0)  # fmt: skip
    assert result["prefill_with_hog_over_alone"]["engine"] == pytest.approx(1.9)
    assert result["cores_by_arm"] == {
        "alone": cores, "engine": {"worker": pytest.approx(1.6), "engine_core": 0.2}}  # fmt: skip
    text = corun.render(result)
    assert "| 1.25x | 1.05x | 1.90x |" in text
    assert "| engine | 0.20 | 1.60 |" in text
    assert "| - | - | 2.10x |" in text
