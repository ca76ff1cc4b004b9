"""Building blocks of the two-engine vLLM scenarios (runner steps, tier entries, checks).

A scenario is a JSON object for :mod:`kvpeer.integrations.vllm.runner`; the helpers
here build its steps and the ``secondary_tiers`` entries, and check what came back.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpeer.integrations.vllm.launcher import EngineLauncher, EngineOutcome, Generation

PROMPT_TOKENS = 256
BLOCK_TOKENS = 32
GENERATED_TOKENS = 8
MIN_PEER_TOKENS = PROMPT_TOKENS - BLOCK_TOKENS
LOGPROB_TOLERANCE = 1e-4
CPU_BYTES = 64 * 1024 * 1024
HOST = "127.0.0.1"
PEER_TIMEOUT_S = 10.0  # load, lookup and handshake timeouts of the kvpeer tiers
SIGNAL_TIMEOUT_S = 300.0  # backstop only: a failed partner is stopped at once

RecordProperty = Callable[[str, object], None]  # pytest's ``record_property`` fixture


@dataclass(frozen=True)
class Pair:
    producer: EngineOutcome
    consumer: EngineOutcome


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


WARMUP_PROMPT = prompt(14, length=40)  # the first generate of an engine is slow


def kvpeer_tier(port: int, plane: str, timeout_s: float = PEER_TIMEOUT_S) -> dict[str, Any]:
    return {
        "type": "KVPeerTier",
        "module_path": "kvpeer.integrations.vllm",
        "host": HOST,
        "port": port,
        "data_transports": [plane],
        "load_timeout_s": timeout_s,
        "lookup_timeout_s": timeout_s,
        "handshake_timeout_s": timeout_s,
    }


def vllm_p2p_tier(port: int) -> dict[str, Any]:
    """vLLM 0.32's own ``p2p`` tier (NIXL over UCX; it has no timeouts to set)."""
    return {"type": "p2p", "host": HOST, "port": port}


def engine(
    launcher: EngineLauncher, tier: dict[str, Any], steps: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "model": str(launcher.model),
        "engine_id": launcher.new_engine_id(),
        "spec_name": "CpuTieringOffloadingSpec",
        "cpu_bytes_to_use": CPU_BYTES,
        "extra_config": {"secondary_tiers": [tier]},
        "steps": steps,
    }


def generate(label: str, tokens: list[int], params: dict[str, Any] | None = None) -> dict[str, Any]:
    step: dict[str, Any] = {
        "op": "generate",
        "label": label,
        "prompt": tokens,
        "max_tokens": GENERATED_TOKENS,
    }
    if params is not None:
        step["kv_transfer_params"] = params
    return step


WARMUP = {**generate("warmup", WARMUP_PROMPT), "max_tokens": 2}
CORRUPT_PRIMARY = {"op": "corrupt_primary"}


def signal(path: Path) -> dict[str, Any]:
    return {"op": "signal", "file": str(path)}


def hold_until(label: str, path: Path) -> dict[str, Any]:
    return {"op": "hold", "label": label, "until_file": str(path), "timeout_s": SIGNAL_TIMEOUT_S}


def remote_decoder(kv_request_id: str) -> dict[str, Any]:
    return {"remote_decoder": {"kv_request_id": kv_request_id}}


def remote_source(role: str, kv_request_id: str, port: int) -> dict[str, Any]:
    return {role: {"kv_request_id": kv_request_id, "remote_host": HOST, "remote_port": port}}


def request_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


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
