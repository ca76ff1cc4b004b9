"""The fleet model against real engines: a preset from ``bench trace --probe``'s figures,
and the model's TTFT beside the bench's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvpeer.cli import main
from kvpeer.errors import ConfigError
from kvpeer.lab.fleet.calibrate import calibrate, line_fit, pooled_probe
from kvpeer.lab.fleet.compare import render_versus, versus
from kvpeer.lab.fleet.params import (
    CPU_PAIR,
    CPU_PAIR_PROBES,
    CPU_PAIR_SHAPE,
    ENGINES,
    LINKS,
    GpuModel,
)

ROOT = Path(__file__).resolve().parents[2]

#: a machine to measure: 10 us per token, an attention cost, 20 ms a step, 50 ms a request
KNOWN = replace(CPU_PAIR_SHAPE, peak_flops=CPU_PAIR_SHAPE.flops_per_token / 1e-5, mfu=1.0,
                hidden=100, hbm_bytes_s=1e18, step_overhead_s=0.02,
                request_overhead_s=0.05)
LINK_BYTES_S, LINK_SETUP_S = 2e9, 0.004


def probe_of(gpu: GpuModel) -> dict[str, object]:
    """What bench trace --probe would measure on engines that behave as ``gpu`` says."""
    kv = gpu.kv_bytes_per_token
    hit = gpu.request_overhead_s + gpu.step_s([(32, 1984)], 0, 0)
    return {
        "prefill_ttft_s": {str(n): gpu.request_overhead_s + gpu.prefill_alone_s(n)
                           for n in (64, 512, 1024, 1536, 2016)},
        "hit_ttft_s": hit,
        "decode_step_s": {"1": gpu.step_s([], 1, 0), "4": gpu.step_s([], 4, 0)},
        "pull_ttft_s": {str(n): hit + LINK_SETUP_S + n * kv / LINK_BYTES_S
                        for n in (1024, 1536, 2016)},
    }


def test_a_probe_of_known_engines_gives_back_their_figures() -> None:
    found = calibrate(probe_of(KNOWN), CPU_PAIR_SHAPE)
    gpu = found.gpu
    assert gpu.peak_flops * gpu.mfu == pytest.approx(KNOWN.peak_flops, rel=1e-6)
    assert gpu.attention_flops == pytest.approx(KNOWN.attention_flops, rel=1e-3)
    assert gpu.step_overhead_s == pytest.approx(0.02, rel=1e-6)
    assert gpu.request_overhead_s == pytest.approx(0.05, rel=1e-6)
    for n in (100, 2000):
        assert gpu.prefill_alone_s(n) == pytest.approx(KNOWN.prefill_alone_s(n), rel=1e-4)
    assert found.link is not None
    assert found.link.bytes_s == pytest.approx(LINK_BYTES_S, rel=1e-6)
    assert found.link.setup_s == pytest.approx(LINK_SETUP_S, rel=1e-6)
    # what is not probed is the bench's configuration
    assert (gpu.max_num_seqs, gpu.step_tokens, gpu.kv_tokens) == (4, 2048, 43690)


def test_engines_that_share_cores_are_calibrated_as_a_busy_pair() -> None:
    """Rule 3: both engines prefilling at once take twice as long: compute at half the
    rate; the overheads (measured alone) are as they were."""
    probe = probe_of(KNOWN)
    alone = calibrate(probe, CPU_PAIR_SHAPE)
    longest = KNOWN.request_overhead_s + KNOWN.prefill_alone_s(2016)
    pair = calibrate({**probe, "pair_prefill_ttft_s": {"2016": 2 * longest}}, CPU_PAIR_SHAPE)
    assert pair.fit["pair_slowdown"] == pytest.approx(2.0)
    assert pair.gpu.peak_flops == pytest.approx(alone.gpu.peak_flops / 2)
    assert pair.gpu.step_overhead_s == pytest.approx(0.02, rel=1e-6)
    assert pair.gpu.request_overhead_s == pytest.approx(0.05, rel=1e-6)  # probed alone
    faster = calibrate({**probe, "pair_prefill_ttft_s": {"2016": longest / 2}}, CPU_PAIR_SHAPE)
    assert faster.fit["pair_slowdown"] == 1.0  # never faster than alone


def test_a_probed_front_end_shares_the_cores_instead_of_slowing_every_step() -> None:
    """Rule 5: the front end's CPU (every role but the workers, summed) per request and
    per token, the host's cores; the pair's slowdown is then the co-run slowdown the
    model applies while both engines step, and the FLOP/s stay the engine's alone;
    the front end's per-request CPU comes off the request overhead."""
    probe = probe_of(KNOWN)
    longest = KNOWN.request_overhead_s + KNOWN.prefill_alone_s(2016)
    roles = {"worker": 0.3, "core": 0.01, "server": 0.02, "router": 0.004, "sender": 0.001}
    tokens = {"worker": 0.006, "core": 0.0015, "server": 0.0004, "router": 0.0002,
              "sender": 0.0001}
    probe |= {"pair_prefill_ttft_s": {"2016": 1.5 * longest},
              "frontend": {"cpu_s_per_request": roles, "cpu_s_per_output_token": tokens,
                           "cores": 2}}
    alone = calibrate(probe_of(KNOWN), CPU_PAIR_SHAPE).gpu
    gpu = calibrate(probe, CPU_PAIR_SHAPE).gpu
    assert gpu.peak_flops == pytest.approx(alone.peak_flops)
    assert gpu.co_run_slowdown == pytest.approx(1.5)
    assert gpu.host_cores == 2
    assert gpu.frontend_s_per_request == pytest.approx(0.035)
    assert gpu.frontend_s_per_token == pytest.approx(0.0022)
    assert gpu.request_overhead_s == pytest.approx(0.05 - 0.035, rel=1e-5)
    pooled = pooled_probe({"1": probe, "2": probe | {"frontend": {
        "cpu_s_per_request": {r: 3 * v for r, v in roles.items()},
        "cpu_s_per_output_token": tokens, "cores": 2}}, "3": probe_of(KNOWN)})
    assert pooled["frontend"]["cpu_s_per_request"]["server"] == pytest.approx(0.04)  # median
    # pooled without rule 6's figure, the scheduler's CPU is still there to count
    assert calibrate(pooled, CPU_PAIR_SHAPE).gpu.frontend_s_per_request == pytest.approx(
        0.5 * (0.035 + 3 * 0.035))


def test_a_scheduler_that_runs_beside_its_worker_is_counted_by_the_time_it_steps() -> None:
    """Rule 6: the scheduler used 0.25 cores while the worker used 0.5 over the prefills
    alone: 0.5 cores per stepping engine, not CPU per request or token; a pair is then
    2 x 1.5 threads on 2 cores, 1.5x by sharing alone, so a pair 3x slower than alone
    leaves a co-run slowdown of 2."""
    probe = probe_of(KNOWN)
    longest = KNOWN.request_overhead_s + KNOWN.prefill_alone_s(2016)
    roles = {"worker": 0.3, "core": 0.01, "server": 0.02, "router": 0.004, "sender": 0.001}
    probe |= {"pair_prefill_ttft_s": {"2016": 3 * longest},
              "prefill_cores_by_role": {"worker": 0.5, "core": 0.25, "server": 0.01},
              "frontend": {"cpu_s_per_request": roles, "cpu_s_per_output_token": roles,
                           "cores": 2}}
    gpu = calibrate(probe, CPU_PAIR_SHAPE).gpu
    assert gpu.scheduler_cores == pytest.approx(0.5)
    assert gpu.frontend_s_per_request == pytest.approx(0.025)  # the core left out
    assert gpu.co_run_slowdown == pytest.approx(2.0)
    assert pooled_probe({"1": probe, "2": probe_of(KNOWN)})["scheduler_cores"] == 0.5


def test_a_pair_taken_in_rounds_and_the_long_prefills_cores_are_preferred() -> None:
    """A probe that pairs each round with a prefill alone says its own slowdown (rule 3),
    and its long prefills' cores say the scheduler's share (rule 6): the figures over
    all lengths, the short prompts' scheduler work included, are not used then."""
    probe = probe_of(KNOWN)
    longest = KNOWN.request_overhead_s + KNOWN.prefill_alone_s(2016)
    roles = {"worker": 0.3, "core": 0.01, "server": 0.02, "router": 0.004, "sender": 0.001}
    probe |= {"pair_prefill_ttft_s": {"2016": 3 * longest}, "pair_slowdown": 1.65,
              "prefill_cores_by_role": {"worker": 0.5, "core": 0.4, "server": 0.01},
              "long_prefill_cores_by_role": {"worker": 0.5, "core": 0.05, "server": 0.01},
              "frontend": {"cpu_s_per_request": roles, "cpu_s_per_output_token": roles,
                           "cores": 2}}  # fmt: skip
    calibration = calibrate(probe, CPU_PAIR_SHAPE)
    gpu = calibration.gpu
    assert gpu.scheduler_cores == pytest.approx(0.1)
    # 2 x 1.1 threads on 2 cores: 1.1x by sharing, so 1.65 leaves 1.5
    assert gpu.co_run_slowdown == pytest.approx(1.5)
    assert calibration.fit["pair_slowdown"] == pytest.approx(1.65)
    pooled = pooled_probe({"1": probe, "2": probe | {"pair_slowdown": 1.25}})
    assert pooled["pair_slowdown"] == pytest.approx(1.45)
    assert pooled["scheduler_cores"] == pytest.approx(0.1)
    faster = calibrate(probe | {"pair_slowdown": 0.9}, CPU_PAIR_SHAPE).gpu
    assert faster.co_run_slowdown == 1.0  # a pair is never faster than alone


def test_a_probe_without_pulls_gives_no_link_and_a_flat_one_is_refused() -> None:
    probe = probe_of(KNOWN)
    del probe["pull_ttft_s"]
    assert calibrate(probe, CPU_PAIR_SHAPE).link is None
    flat = {**probe, "prefill_ttft_s": {"64": 0.1, "512": 0.1, "1024": 0.1}}
    with pytest.raises(ConfigError, match="does not grow"):
        calibrate(flat, CPU_PAIR_SHAPE)
    with pytest.raises(ConfigError, match="two distinct"):
        line_fit([1.0, 1.0], [2.0, 3.0])


def test_the_cpu_preset_is_the_bench_configuration_with_measured_costs() -> None:
    assert ENGINES["cpu-pair"] is CPU_PAIR
    assert ENGINES["h100"] == GpuModel()
    for name in ("params", "layers", "kv_bytes_per_token", "kv_tokens", "max_num_seqs",
                 "step_tokens"):
        assert getattr(CPU_PAIR, name) == getattr(CPU_PAIR_SHAPE, name)
    assert CPU_PAIR.request_overhead_s >= 0  # measured: 0 (the hit is all step)
    assert CPU_PAIR.step_overhead_s > 0
    assert 0.2 < CPU_PAIR.prefill_alone_s(2016) < 20.0  # seconds on a CPU, not ms
    assert LINKS["shm"].bytes_s > 1e8
    assert LINKS["shm"].setup_s >= 0


def test_the_cpu_preset_is_what_its_committed_probes_give() -> None:
    """No figure of CPU_PAIR or the shm link is typed in: each is what --calibrate gives
    from the raw bench results it names (to the digits written)."""
    probes: dict[str, Any] = {}
    for path in CPU_PAIR_PROBES:
        bench = json.loads((ROOT / path).read_text())
        assert bench["ok"]
        assert bench["probes"]
        probes.update({f"{path}:{arm}": p for arm, p in bench["probes"].items()})
    found = calibrate(pooled_probe(probes), CPU_PAIR_SHAPE)
    for name in ("peak_flops", "hidden", "step_overhead_s", "request_overhead_s", "mfu",
                 "host_cores", "frontend_s_per_request", "frontend_s_per_token",
                 "scheduler_cores", "co_run_slowdown"):
        assert getattr(CPU_PAIR, name) == pytest.approx(getattr(found.gpu, name), rel=1e-5,
                                                        abs=1e-9), name
    assert found.link is not None
    assert LINKS["shm"].bytes_s == pytest.approx(found.link.bytes_s, rel=1e-5)
    assert LINKS["shm"].setup_s == pytest.approx(found.link.setup_s, rel=1e-5)


def bench_result() -> dict[str, object]:
    return {"arms": [
        {"arm": "affinity", "turns": 2, "ttft_mean_s": 2.0, "ttft_p50_s": 1.0,
         "ttft_p90_s": 4.0, "reuse_realised": 0.5},
        {"arm": "kvpeer", "turns": 2, "ttft_p50_s": 0.8, "ttft_p90_s": 2.0,
         "reuse_realised": 0.9},
        {"arm": "vllm-p2p", "turns": 2, "ttft_p50_s": 0.8, "ttft_p90_s": 2.0,
         "reuse_realised": 0.9},
    ]}


def model_result() -> dict[str, list[dict[str, Any]]]:
    return {"runs": [
        {"policy": "pooled", "ttft_p50_s": 0.1, "ttft_p90_s": 0.1, "reuse": 1.0},
        {"policy": "affinity", "ttft_mean_s": 1.6, "ttft_p50_s": 1.2, "ttft_p90_s": 5.2,
         "reuse": 0.4},
        {"policy": "kvpeer", "ttft_p50_s": 0.7, "ttft_p90_s": 2.4, "reuse": 0.8},
        {"policy": "kvpeer", "ttft_p50_s": 9.0, "ttft_p90_s": 9.0, "reuse": 0.8},
    ]}


def test_predicted_is_set_beside_measured_per_arm_with_its_ratio() -> None:
    rows = versus(model_result(), bench_result())
    assert [r["arm"] for r in rows] == ["affinity", "kvpeer"]  # no bound, no model of p2p
    affinity, kvpeer = rows
    assert affinity["p50"] == {"predicted_s": 1.2, "measured_s": 1.0,
                               "ratio": pytest.approx(1.2), "within": True}
    assert affinity["p90"]["ratio"] == pytest.approx(1.3)
    assert affinity["mean"]["ratio"] == pytest.approx(0.8)
    assert "mean" not in kvpeer  # the bench's kvpeer row has no mean: left out
    # nor has its result turns to take it from; with them, it is their means' median
    with_turns = {**bench_result(), "turns": [
        {"arm": "kvpeer", "per_request": [[0.0, 1.0, 64, "a", "cache"],
                                          [0.0, 2.0, 64, "b", "cache"]]},
        {"arm": "kvpeer", "per_request": [[0.0, 3.0, 64, "a", "cache"]]},
        {"arm": "kvpeer", "per_request": [[0.0, 4.0, 64, "a", "cache"]]},
    ]}
    model = model_result()
    model["runs"][2]["ttft_mean_s"] = 3.0
    kvpeer = versus(model, with_turns)[1]
    assert kvpeer["mean"]["measured_s"] == 3.0  # the median of 1.5, 3 and 4
    assert not affinity["p90"]["within"]  # 30 % off: outside 25 %
    assert kvpeer["p50"]["ratio"] == pytest.approx(0.875)  # the first kvpeer run
    assert kvpeer["p90"]["within"]
    assert kvpeer["reuse"] == {"predicted": 0.8, "measured": 0.9}
    text = render_versus(rows)
    assert "affinity" in text
    assert "1.30" in text
    assert text.splitlines()[1].endswith("no")
    assert text.splitlines()[2].endswith("yes")


def test_the_command_prints_predicted_beside_measured_from_two_saved_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"trace": "t.jsonl", "window_s": None, "gpu": "g",
                                 "facts": {"requests": 3, "infinite_reuse": 0.0,
                                           "infinite_reuse_full_blocks": 0.0,
                                           "capacity_rps_per_engine": 1.0},
                                 "runs": []}))
    full = json.loads(model.read_text())
    full["runs"] = [{**r, "engines": 2, "load": 0.5, "link": "shm", "ttft_p99_s": 9.0,
                     "goodput": 1.0, "pulls": 0, "bytes_moved": 0,
                     "router_cpu_us_per_decision": 1.0} for r in model_result()["runs"]]
    model.write_text(json.dumps(full))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(bench_result()))
    assert main(["lab", "fleet", "--from-json", str(model), "--measured", str(bench)]) == 0
    out = capsys.readouterr().out
    assert "predicted (the model) against measured" in out
    assert "kvpeer" in out.split("against measured")[1]


def test_the_command_prints_the_preset_from_a_benchs_probes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with_pulls = probe_of(KNOWN)
    without = {k: v for k, v in with_pulls.items() if k != "pull_ttft_s"}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"probes": {"affinity": without, "kvpeer": with_pulls,
                                            "load": {"error": "probe request failed"}}}))
    assert main(["lab", "fleet", "--calibrate", str(bench), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["calibration"]
    assert figures["step_overhead_s"] == pytest.approx(0.02, rel=1e-6)
    assert figures["request_overhead_s"] == pytest.approx(0.05, rel=1e-6)
    assert figures["link_bytes_s"] == pytest.approx(LINK_BYTES_S, rel=1e-6)
    assert main(["lab", "fleet", "--calibrate", str(bench)]) == 0
    assert "step_overhead_s" in capsys.readouterr().out
    bench.write_text(json.dumps({"probes": {}}))
    assert main(["lab", "fleet", "--calibrate", str(bench)]) == 2
