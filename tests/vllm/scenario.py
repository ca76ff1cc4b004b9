"""The two-engine vLLM tests' constants and checks, over the scenario builders of
:mod:`kvpeer.lab.engines.scenario` (re-exported here with the tests' defaults).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpeer.lab.engines import scenario
from kvpeer.lab.engines.launcher import EngineLauncher, EngineOutcome, Generation
from kvpeer.lab.engines.runner import FreezeWatch
from kvpeer.lab.engines.scenario import (
    CPU_BYTES,
    GENERATED_TOKENS,
    HOST,
    SIGNAL_TIMEOUT_S,
    generate,
    hold_until,
    prompt,
    remote_decoder,
    remote_source,
    request_id,
    signal,
    vllm_p2p_tier,
    warmup,
)

__all__ = [  # the package's builders, re-exported for the tests, and this module's own
    "BLOCK_TOKENS",
    "CORRUPT_PRIMARY",
    "CPU_BYTES",
    "FREEZE_S",
    "GENERATED_TOKENS",
    "HOST",
    "LOGPROB_TOLERANCE",
    "MIN_PEER_TOKENS",
    "PEER_TIMEOUT_S",
    "PROMPT_TOKENS",
    "SIGNAL_TIMEOUT_S",
    "WARMUP",
    "FreezeWatch",
    "Pair",
    "RecordProperty",
    "assert_computed_locally",
    "assert_output_differs",
    "assert_pulled_from_peer",
    "assert_same_output",
    "engine",
    "generate",
    "hold_until",
    "kvpeer_tier",
    "prompt",
    "remote_decoder",
    "remote_source",
    "report",
    "request_id",
    "signal",
    "vllm_p2p_tier",
]

PROMPT_TOKENS = 256
BLOCK_TOKENS = 32
MIN_PEER_TOKENS = PROMPT_TOKENS - BLOCK_TOKENS
LOGPROB_TOLERANCE = 1e-4
PEER_TIMEOUT_S = 10.0  # load, lookup and handshake timeouts of the kvpeer tiers

RecordProperty = Callable[[str, object], None]  # pytest's ``record_property`` fixture
# A stall of the whole machine this long (this process not scheduled at all) can expire
# ZMQ's 10 s heartbeats on every link once it resumes (seen here: 14 s).
FREEZE_S = 5.0


@dataclass(frozen=True)
class Pair:
    producer: EngineOutcome
    consumer: EngineOutcome


def kvpeer_tier(port: int, plane: str, timeout_s: float = PEER_TIMEOUT_S) -> dict[str, Any]:
    return scenario.kvpeer_tier(port, plane, timeout_s)


def engine(
    launcher: EngineLauncher, tier: dict[str, Any], steps: list[dict[str, Any]]
) -> dict[str, Any]:
    return scenario.engine_scenario(launcher.model, launcher.new_engine_id(), tier, steps)


WARMUP = warmup()
CORRUPT_PRIMARY = {"op": "corrupt_primary"}


# --- checks ------------------------------------------------------------------------------


def assert_same_output(got: Generation, want: Generation) -> None:
    assert got.tokens == want.tokens
    delta = got.max_logprob_delta(want)
    assert delta <= LOGPROB_TOLERANCE, f"max |Δlogprob| {delta}"


def assert_computed_locally(run: Generation) -> None:
    """The run is a local reference: a fresh engine computed every prompt token."""
    assert run.num_cached_tokens == 0


def assert_pulled_from_peer(run: Generation) -> None:
    """A consumer that never saw the prompt computed at most one block of it."""
    assert run.num_cached_tokens >= MIN_PEER_TOKENS, (
        f"consumer computed {PROMPT_TOKENS - run.num_cached_tokens} of {PROMPT_TOKENS} "
        "prompt tokens itself"
    )


def assert_output_differs(got: Generation, want: Generation) -> None:
    """For a negative control: output from corrupted KV must not match the reference."""
    assert got.tokens != want.tokens or got.max_logprob_delta(want) > 100 * LOGPROB_TOLERANCE, (
        "outputs from corrupted peer KV equal the reference: the checks do not see the bytes"
    )


def report(record_property: RecordProperty, name: str, value: float) -> None:
    """Record a measurement as a junit property and print it (``pytest -s``)."""
    record_property(name, round(value, 4))
    print(f"{name}: {value:.4f}")
