"""Producer faults in two real ``vllm serve`` engines (issue 11, item 3), kvpeer tier.

One producer/consumer pair on the tiny model runs every fault of ``kvpeer bench faults``
once (the same driver, :func:`kvpeer.lab.bench.faults_run.measure_tier`): the consumer's
output must equal its local run of the same prompt, and each fallback (request latency
less that local run) must be within the fault's bound: 0.25 s when the producer is gone
before the request (refused) or backed off, the 2 s request budget otherwise (frozen,
killed while the request waits on it, restarted; ``peer_wait_s`` is 1.5 s of it); and
the pair must never have needed starting afresh.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpeer.lab.bench.faults import FAULTS, FaultsSpec, Sample, judge
from kvpeer.lab.bench.faults_run import Pair, Workload, measure_tier

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def measured(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """Every fault once on the kvpeer tier; the pair, stopped."""
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
    return pair


@pytest.fixture(scope="module")
def samples(measured: Pair) -> list[Sample]:
    return measured.samples


def test_the_pair_never_had_to_be_started_afresh(measured: Pair) -> None:
    assert measured.renewals == []


# Issue 11 item 3: every fault within its bound, strictly. Past over-bound rows, now
# judged by the request budget for what the kernel and a fresh process cost
# (kvpeer.lab.bench.faults): the two killed rows (a killed producer's sockets close only
# after the kernel tore its memory down: 150-432 ms) and restarted (a fresh process's
# first contact: 30-780 ms in eight runs, 621 ms in a CI run, median ~120 ms).


def of(samples: list[Sample], fault: str) -> list[Sample]:
    runs = [sample for sample in samples if sample.fault == fault]
    assert runs, f"{fault} was not measured"
    return runs


@pytest.mark.parametrize("fault", [fault.name for fault in FAULTS])
def test_every_consumer_output_equals_its_local_run(samples: list[Sample], fault: str) -> None:
    for sample in of(samples, fault):
        assert not sample.error
        assert sample.outputs_equal


@pytest.mark.parametrize("fault", [fault.name for fault in FAULTS])
def test_each_fallback_is_within_its_bound(samples: list[Sample], fault: str) -> None:
    runs = of(samples, fault)
    cell = judge("kvpeer", fault, runs)
    assert cell.problems == (), [(s.fallback_s, s.phase, s.producer_gone_s) for s in runs]


def test_healthy_pulls_really_pull(samples: list[Sample]) -> None:
    (healthy,) = [sample for sample in samples if sample.fault == "healthy"]
    assert healthy.cached_tokens >= 384 - 32
