"""Producer faults in two real ``vllm serve`` engines (issue 11, item 3), kvpeer tier.

One producer/consumer pair on the tiny model runs every fault of ``kvpeer bench faults``
once (the same driver, :func:`kvpeer.bench.faults_run.measure_tier`): the consumer's
output must equal its local run of the same prompt, and each fallback (request latency
less that local run) must be within the fault's bound: 0.25 s when the producer is gone
or answers, the 2 s request budget when it does not answer at all (``peer_wait_s`` is
1.5 s of it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpeer.bench.faults import FAULTS, FaultsSpec, Sample, judge
from kvpeer.bench.faults_run import Pair, Workload, measure_tier

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def samples(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Sample]:
    pair = Pair(
        "kvpeer",
        Workload(tiny_llama, prompt_tokens=384, max_model_len=512),
        tmp_path_factory.mktemp("fault-logs"),
        progress=print,
    )
    try:
        pair.start()
        measure_tier(pair, FaultsSpec(runs=1, tiers=("kvpeer",)))
    finally:
        pair.close()
    return pair.samples


# Findings of issue 11 item 3 (bounds are not loosened; these fail until fixed, or pass by
# luck of timing, so they are not strict). No longer here: frozen-first-contact and
# frozen-in-session (the request waits peer_wait_s, 1.5 s, then recomputes: 1.50 and
# 1.51 s in all ten runs of the five-run table). restarted is back: over its bound in
# 2 of 5 runs of that table and in a CI run.
KNOWN_OVER_BOUND = {
    "killed-during-lookup": "0.6-0.9 s in one run on the busy 2-core machine, 41-155 ms in "
    "later ones (session closed as unreachable: control link lost); the producer is now "
    "stopped before the request and killed after it, not yet measured over five runs",
    "killed-mid-transfer": "246 and 313 ms in the runs that met the fault (on this model "
    "the pull mostly finishes before the kill); cause of the slow ones not pinned down",
    "restarted": "34-42 ms in 3 of 5 runs of kvpeer bench faults --quick --runs 5, 134 and "
    "267 ms in the other two, 155 ms and over 250 ms in CI runs: the slow runs' counters "
    "match the fast ones' (a new session, a fetch answered failed); cause not pinned down",
}


def of(samples: list[Sample], fault: str) -> list[Sample]:
    runs = [sample for sample in samples if sample.fault == fault]
    assert runs, f"{fault} was not measured"
    return runs


@pytest.mark.parametrize("fault", [fault.name for fault in FAULTS])
def test_every_consumer_output_equals_its_local_run(samples: list[Sample], fault: str) -> None:
    for sample in of(samples, fault):
        assert not sample.error
        assert sample.outputs_equal


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(
            fault.name,
            marks=[pytest.mark.xfail(reason=KNOWN_OVER_BOUND[fault.name], strict=False)]
            if fault.name in KNOWN_OVER_BOUND
            else [],
        )
        for fault in FAULTS
    ],
)
def test_each_fallback_is_within_its_bound(samples: list[Sample], fault: str) -> None:
    runs = of(samples, fault)
    cell = judge("kvpeer", fault, runs)
    assert cell.problems == (), [(s.fallback_s, s.phase, s.producer_gone_s) for s in runs]


def test_healthy_pulls_really_pull(samples: list[Sample]) -> None:
    (healthy,) = [sample for sample in samples if sample.fault == "healthy"]
    assert healthy.cached_tokens >= 384 - 32
