"""Producer faults in two real ``vllm serve`` engines (issue 11, item 3), kvpeer tier.

One producer/consumer pair on the tiny model runs every fault of ``kvpeer bench faults``
once (the same driver, :func:`kvpeer.bench.faults_run.measure_tier`): the consumer's
output must equal its local run of the same prompt, and each fallback (request latency
less that local run) must be within the fault's bound: 0.25 s when the producer is gone
before the request or answers, the 2 s request budget when it does not answer at all
(frozen, or killed while the request waits on it; ``peer_wait_s`` is 1.5 s of it).
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
# 1.51 s in all ten runs of the five-run table), and the two killed rows: a producer
# killed while a request waits on it is silent until the kernel has torn its memory down
# and closes its sockets (150-432 ms in five stopped-then-killed runs), so the request
# budget is their bound (kvpeer.bench.faults). restarted is back: over its bound in 2 of
# 5 runs of that table and in a CI run.
KNOWN_OVER_BOUND = {
    "restarted": "29-164 ms in five runs of kvpeer bench faults --quick (34-267 ms in an "
    "earlier five), 621 ms in a CI run: the time is in the handshake with the new process "
    "(trace: connect to connect_ack 21-163 ms; the producer read the connect 112 ms after "
    "it was sent and answered in 0.1 ms); not pinned down further",
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
