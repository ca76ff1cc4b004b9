"""kvpeer and vLLM's own ``p2p`` tier, the same symmetric pull, compared on vLLM's own
per-tier lookup-delay histogram (``vllm:kv_offload_tiering_lookup_async_delay_seconds``:
from a tier lookup first answering "retry" until it resolves).

Each tier gets a fresh pair of ``vllm serve`` engines; engine ``b`` pulls a prompt that
only ``a`` computed (``remote_kv_source``). Both tiers must move the histogram on ``b``
and give ``b`` the prompt's blocks; the two delays are printed side by side (the numbers
go in the issue notes; on this shared machine they are not asserted against each other).
"""

from __future__ import annotations

import json
import random
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client.parser import text_string_to_metric_families

from kvpeer.lab.engines.serving import ServeFleet, ServeSpec, TierKind
from kvpeer.transport.data.nixl import NixlBackend

DELAY = "vllm:kv_offload_tiering_lookup_async_delay_seconds"
PROMPT = 1024
BLOCK = 32
ATTEMPTS = 3  # pulls vLLM's tier gets (kvpeer: one)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
        return answer


def delay(url: str) -> tuple[float, float]:
    """(count, sum) of the lookup-delay histogram over the secondary tiers' labels."""
    # vLLM's p2p tier steps without pause (its notes' bug 8): on a loaded machine its
    # API server answers /metrics late, which is not what this test compares
    with urllib.request.urlopen(url + "/metrics", timeout=60) as reply:
        text = reply.read().decode()
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == DELAY + "_count":
                count += sample.value
            elif sample.name == DELAY + "_sum":
                total += sample.value
    return count, total


def pull_once(tier: TierKind, model: Path, logs: Path) -> dict[str, float]:
    rng = random.Random(tier)
    greedy = {"model": "kvpeer-demo", "max_tokens": 4, "temperature": 0.0,
              "ignore_eos": True, "return_token_ids": True}
    with ServeFleet(logs / tier) as fleet:
        fleet.start([ServeSpec(name, model, tier=tier) for name in "ab"])
        a, b = (fleet.engines[name].spec for name in "ab")
        for spec in (a, b):  # warm-up: each engine's first request is slow
            post(spec.url, {**greedy, "prompt": [rng.randrange(3, 512) for _ in range(64)]})
        # kvpeer must pull at its first contact; vLLM's tier, the baseline, gets
        # ATTEMPTS fresh prompts: on a loaded machine its first contact sometimes falls
        # back (CI, 2026-12-02: 0 tokens cached), which is not what this test compares.
        for _attempt in range(1 if tier == "kvpeer" else ATTEMPTS):
            prompt = [rng.randrange(3, 512) for _ in range(PROMPT)]
            computed = post(a.url, {**greedy, "prompt": prompt})
            before = delay(b.url)
            source = {"kv_request_id": uuid.uuid4().hex, "remote_host": "127.0.0.1",
                      "remote_port": a.tier_port}
            pulled = post(b.url, {**greedy, "prompt": prompt,
                                  "kv_transfer_params": {"remote_kv_source": source}})
            post(b.url, {**greedy, "prompt": [rng.randrange(3, 512) for _ in range(40)]})
            after = delay(b.url)  # (the request above: a step that reports the lookup)
            assert pulled["choices"][0]["token_ids"] == computed["choices"][0]["token_ids"]
            cached = pulled["usage"]["prompt_tokens_details"]["cached_tokens"]
            if cached >= PROMPT - BLOCK:
                break
    assert cached >= PROMPT - BLOCK, f"{tier}: only {cached} tokens cached"
    lookups = after[0] - before[0]
    assert lookups > 0, f"{tier}: the lookup-delay histogram did not move"
    return {"lookups": lookups, "mean_delay_s": (after[1] - before[1]) / lookups}


def test_kvpeer_and_vllm_p2p_on_vllms_lookup_delay_histogram(
    serve_llama: Path, tmp_path: Path
) -> None:
    if not NixlBackend.available():
        pytest.skip("vLLM's p2p tier runs on NIXL, which is not installed here")
    results = {tier: pull_once(tier, serve_llama, tmp_path) for tier in ("kvpeer", "p2p")}
    print(
        "lookup async delay on the consumer (mean of its lookups): "
        + ", ".join(
            f"{tier} {r['mean_delay_s'] * 1000:.1f} ms over {r['lookups']:.0f}"
            for tier, r in results.items()
        )
    )
