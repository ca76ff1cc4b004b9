"""Building blocks of engine scenarios for :mod:`kvpeer.lab.engines.runner`.

A scenario is a JSON object: the engine's model, its ``secondary_tiers`` entry and a
list of steps. ``kvpeer demo``, ``kvpeer bench idle`` and the real-vLLM tests build
theirs from these pieces, so every engine they start is configured the same way.
Engines that work together meet through signal files: one ``signal``\\s, the other
``hold``\\s until the file exists.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_BYTES",
    "GENERATED_TOKENS",
    "HOST",
    "SIGNAL_TIMEOUT_S",
    "engine_scenario",
    "generate",
    "hold_until",
    "kvpeer_tier",
    "prompt",
    "remote_decoder",
    "remote_source",
    "request_id",
    "signal",
    "vllm_p2p_tier",
    "warmup",
]

HOST = "127.0.0.1"
CPU_BYTES = 64 * 1024 * 1024  # the engine's primary (CPU) region
GENERATED_TOKENS = 8
SIGNAL_TIMEOUT_S = 300.0  # backstop only: launchers stop a failed engine's partners at once
VOCAB = (3, 512)  # token ids of the tiny model, past its special tokens
WARMUP_TOKENS = 40


def prompt(seed: int, length: int = 256) -> list[int]:
    """``length`` token ids drawn from ``seed``: prompts of different seeds share no block."""
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(length)]


def kvpeer_tier(
    port: int,
    planes: str | Sequence[str],
    timeout_s: float | None = None,
    *,
    host: str = HOST,
    short_name: bool = False,
) -> dict[str, Any]:
    """A kvpeer tier entry on ``planes`` with load, lookup and handshake timeouts and a
    request budget (``peer_wait_s``) of ``timeout_s`` (None: kvpeer's defaults);
    ``short_name`` uses the type kvpeer's vLLM plugin registers.

    The budget goes with the timeouts: a test that waits for a healthy peer on a loaded
    machine must not fall back after the 1.5 s default while a first contact (a NIXL
    registration, a producer answering only in its serve windows) takes longer; CI saw
    both (``test_interop``, ``test_warm_and_symmetric``). Budgets are ``test_faults``'
    subject. The producer's wait for its busy engine (``engine_wait_s``) goes with them
    too: a loaded machine's engine steps can outlast the 0.25 s default, and these tests
    check that blocks come from the peer, not the bound (tests/session/test_engine_wait.py
    and tests/node/test_tier_engine_wait.py do)."""
    entry: dict[str, Any] = (
        {"type": "kvpeer"}
        if short_name
        else {"type": "KVPeerTier", "module_path": "kvpeer.integrations.vllm"}
    )
    entry.update(
        host=host,
        port=port,
        data_transports=[planes] if isinstance(planes, str) else list(planes),
    )
    if "nixl" in entry["data_transports"]:
        entry["nixl_peers"] = ["127.0.0.0/8"]  # the other engines run on this machine
    if timeout_s is not None:
        entry.update(load_timeout_s=timeout_s, lookup_timeout_s=timeout_s)
        entry.update(handshake_timeout_s=timeout_s, peer_wait_s=timeout_s,
                     engine_wait_s=timeout_s)  # fmt: skip
    return entry


def vllm_p2p_tier(port: int, *, host: str = HOST) -> dict[str, Any]:
    """vLLM 0.32's own ``p2p`` tier (NIXL over UCX; it has no timeouts to set)."""
    return {"type": "p2p", "host": host, "port": port}


def engine_scenario(
    model: str | Path,
    engine_id: str,
    tiers: dict[str, Any] | Sequence[dict[str, Any]],
    steps: list[dict[str, Any]],
    *,
    cpu_bytes: int = CPU_BYTES,
) -> dict[str, Any]:
    """One engine on kvpeer's CPU offloading spec with ``tiers`` as secondary tiers."""
    return {
        "model": str(model),
        "engine_id": engine_id,
        "spec_name": "CpuTieringOffloadingSpec",
        "cpu_bytes_to_use": cpu_bytes,
        "extra_config": {"secondary_tiers": [tiers] if isinstance(tiers, dict) else list(tiers)},
        "steps": steps,
    }


def generate(
    label: str,
    tokens: list[int],
    params: dict[str, Any] | None = None,
    *,
    max_tokens: int = GENERATED_TOKENS,
) -> dict[str, Any]:
    """Greedy generation of ``tokens``; ``params`` are the request's kv_transfer_params."""
    step: dict[str, Any] = {
        "op": "generate",
        "label": label,
        "prompt": tokens,
        "max_tokens": max_tokens,
    }
    if params is not None:
        step["kv_transfer_params"] = params
    return step


def warmup() -> dict[str, Any]:
    """An engine's first generate is slow: this one keeps that out of measured runs."""
    return generate("warmup", prompt(14, WARMUP_TOKENS), max_tokens=2)


def signal(path: str | Path) -> dict[str, Any]:
    return {"op": "signal", "file": str(path)}


def hold_until(label: str, path: str | Path, timeout_s: float = SIGNAL_TIMEOUT_S) -> dict[str, Any]:
    return {"op": "hold", "label": label, "until_file": str(path), "timeout_s": timeout_s}


def remote_decoder(kv_request_id: str) -> dict[str, Any]:
    return {"remote_decoder": {"kv_request_id": kv_request_id}}


def remote_source(
    role: str, kv_request_id: str, port: int, *, host: str = HOST, held_tokens: int | None = None
) -> dict[str, Any]:
    """``role`` (``remote_prefiller`` or ``remote_kv_source``) naming the peer at ``port``;
    ``held_tokens``: what the router says the peer holds (the consumer then asks nothing)."""
    source: dict[str, Any] = {"kv_request_id": kv_request_id, "remote_host": host,
                              "remote_port": port}  # fmt: skip
    if held_tokens is not None:
        source["held_tokens"] = held_tokens
    return {role: source}


def request_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"
