"""Warm producers and symmetric pulls over the shm and nixl planes, with real vLLM engines.

A producer whose prefix cache already holds a prompt must still serve every block
of it to a ``remote_prefiller`` consumer (requirement seed 003: vLLM's own tier once
served nothing then, and the consumer waited out its timeout to compute locally).
Two shapes: the prompt still in the producer's device prefix cache (``gpu-warm``),
and only in its primary CPU region after ``reset_prefix_cache`` (``primary-warm``).
The same pair then shares a third prompt symmetrically (``remote_kv_source``), so
symmetric pulls run on these planes too (test_kvpeer_tier covers tcp).

Producer A runs in vLLM's multiprocessing mode (it must answer lookups while idle);
consumer B in-process, so its kvpeer counters say how many blocks came from A.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvpeer.integrations.vllm.launcher import EngineLauncher, EngineOutcome, free_port
from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend

PROMPT_TOKENS = 256
BLOCK_TOKENS = 32
GENERATED_TOKENS = 8
MIN_PEER_TOKENS = PROMPT_TOKENS - BLOCK_TOKENS
LOGPROB_TOLERANCE = 1e-4
CPU_BYTES = 64 * 1024 * 1024
HOST = "127.0.0.1"
PEER_TIMEOUT_S = 20.0
SIGNAL_TIMEOUT_S = 300.0
SHAPES = ("gpu-warm", "primary-warm", "symmetric")

PLANES = [
    "shm",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not NixlBackend.available(), reason=INSTALL_HINT)
    ),
]


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


PROMPTS = {shape: prompt(21 + i) for i, shape in enumerate(SHAPES)}


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


def hold(label: str, path: Path) -> dict[str, Any]:
    return {"op": "hold", "label": label, "until_file": str(path), "timeout_s": SIGNAL_TIMEOUT_S}


def signal(path: Path) -> dict[str, Any]:
    return {"op": "signal", "file": str(path)}


def engine(
    launcher: EngineLauncher, port: int, plane: str, steps: list[dict[str, Any]]
) -> dict[str, Any]:
    tier = {
        "type": "KVPeerTier",
        "module_path": "kvpeer.integrations.vllm",
        "host": HOST,
        "port": port,
        "data_transports": [plane],
        "load_timeout_s": PEER_TIMEOUT_S,
        "lookup_timeout_s": PEER_TIMEOUT_S,
        "handshake_timeout_s": PEER_TIMEOUT_S,
    }
    return {
        "model": str(launcher.model),
        "engine_id": launcher.new_engine_id(),
        "spec_name": "CpuTieringOffloadingSpec",
        "cpu_bytes_to_use": CPU_BYTES,
        "extra_config": {"secondary_tiers": [tier]},
        "steps": steps,
    }


def run_pair(launcher: EngineLauncher, plane: str, signals: Path) -> tuple[EngineOutcome, ...]:
    producer_port, consumer_port = free_port(), free_port()
    ids = {shape: f"{shape}-{plane}-{uuid.uuid4().hex[:8]}" for shape in SHAPES}
    ready = {shape: signals / f"ready-{shape}" for shape in SHAPES}
    pulled = {shape: signals / f"pulled-{shape}" for shape in SHAPES}
    warm, primary, symmetric = (PROMPTS[shape] for shape in SHAPES)
    producer_steps = [
        {**generate("warmup", prompt(9, 40)), "max_tokens": 2},
        # gpu-warm: computed first, then asked for by a decoder while still cached.
        generate("local-gpu-warm", warm),
        generate("decoder-gpu-warm", warm, {"remote_decoder": {"kv_request_id": ids["gpu-warm"]}}),
        signal(ready["gpu-warm"]),
        hold("serving-gpu-warm", pulled["gpu-warm"]),
        # primary-warm: the device prefix cache is emptied; the CPU primary keeps it.
        generate("local-primary-warm", primary),
        {"op": "reset_prefix_cache"},
        generate(
            "decoder-primary-warm",
            primary,
            {"remote_decoder": {"kv_request_id": ids["primary-warm"]}},
        ),
        signal(ready["primary-warm"]),
        hold("serving-primary-warm", pulled["primary-warm"]),
        generate("local-symmetric", symmetric),
        signal(ready["symmetric"]),
        hold("serving-symmetric", pulled["symmetric"]),
    ]
    consumer_steps: list[dict[str, Any]] = [{**generate("warmup", prompt(9, 40)), "max_tokens": 2}]
    for shape in SHAPES:
        role = "remote_kv_source" if shape == "symmetric" else "remote_prefiller"
        source = {
            role: {"kv_request_id": ids[shape], "remote_host": HOST, "remote_port": producer_port}
        }
        consumer_steps += [
            hold(f"waiting-{shape}", ready[shape]),
            generate(f"pulled-{shape}", PROMPTS[shape], source),
            signal(pulled[shape]),
        ]
    return tuple(
        launcher.run_together(
            [
                (engine(launcher, producer_port, plane, producer_steps), True),
                (engine(launcher, consumer_port, plane, consumer_steps), False),
            ]
        )
    )


@pytest.fixture(scope="module")
def pairs(
    launcher: EngineLauncher, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[tuple[EngineOutcome, ...]]]:
    planes = ["shm"] + (["nixl"] if NixlBackend.available() else [])

    def chain(plane: str) -> Callable[[], tuple[EngineOutcome, ...]]:
        signals = tmp_path_factory.mktemp(f"signals-warm-{plane}")
        return lambda: run_pair(launcher, plane, signals)

    return {plane: launcher.submit(chain(plane)) for plane in planes}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("plane", PLANES)
def test_every_block_comes_from_the_producer(
    pairs: dict[str, Future[tuple[EngineOutcome, ...]]], plane: str, shape: str
) -> None:
    producer, consumer = pairs[plane].result()
    local, pulled = producer.runs[f"local-{shape}"], consumer.runs[f"pulled-{shape}"]

    assert local.num_cached_tokens == 0  # a fresh computation: the reference
    assert pulled.num_cached_tokens >= MIN_PEER_TOKENS
    assert pulled.blocks_from_peer is not None
    assert pulled.blocks_from_peer * BLOCK_TOKENS >= pulled.num_cached_tokens  # all from A
    assert pulled.tokens == local.tokens
    assert pulled.max_logprob_delta(local) <= LOGPROB_TOLERANCE
    assert pulled.seconds < PEER_TIMEOUT_S, "the consumer waited for a timeout"


@pytest.mark.parametrize("plane", PLANES)
def test_the_warm_producer_really_was_warm(
    pairs: dict[str, Future[tuple[EngineOutcome, ...]]], plane: str
) -> None:
    """Guards the scenario: the decoder requests reused the producer's cache."""
    producer, _ = pairs[plane].result()
    assert producer.runs["decoder-gpu-warm"].num_cached_tokens >= MIN_PEER_TOKENS
    assert producer.runs["decoder-primary-warm"].num_cached_tokens >= MIN_PEER_TOKENS
