"""Producer faults in two real ``vllm serve`` engines (issue 11, item 3), kvpeer tier.

One producer/consumer pair on the tiny model runs every fault of ``kvpeer bench faults``
once (the same driver, :func:`kvpeer.bench.faults_run.measure_tier`): the consumer's
output must equal its local run of the same prompt, and each fallback (request latency
less that local run) must be within the fault's bound: 0.25 s when the producer is gone
or answers, ``peer_wait_s`` (2 s) when it does not answer at all.
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


@pytest.mark.parametrize("fault", [fault.name for fault in FAULTS])
def test_the_consumer_output_equals_its_local_run_and_the_fallback_is_bounded(
    samples: list[Sample], fault: str
) -> None:
    runs = [sample for sample in samples if sample.fault == fault]
    assert runs, f"{fault} was not measured"
    cell = judge("kvpeer", fault, runs)
    assert cell.problems == (), [(s.fallback_s, s.phase, s.counters) for s in runs]


def test_healthy_pulls_really_pull(samples: list[Sample]) -> None:
    (healthy,) = [sample for sample in samples if sample.fault == "healthy"]
    assert healthy.cached_tokens >= 384 - 32
