"""Run one vLLM engine scenario and print its outcome as one JSON line (a test helper).

Usage: ``python tests/vllm/engine.py '<scenario json>'``; the tests run it as a
subprocess because vLLM on CPU forces the ``spawn`` start method and keeps
process-wide state. The scenario is a JSON object:

- ``model``: checkpoint directory; ``engine_id``: the connector's ``engine_id``
  (names ``/dev/shm/vllm_offload_<engine_id>.mmap``); ``spec_name``: an offloading
  spec of :mod:`kvpeer.integrations.vllm.cpu_spec`; ``cpu_bytes_to_use``;
  optional ``extra_config``: more ``kv_connector_extra_config`` keys (e.g.
  ``secondary_tiers``, ``blocks_per_chunk``).
- ``steps``, run in order:
  ``{"op": "generate", "label": str, "prompt": [token ids], "max_tokens": int}``;
  ``{"op": "reset_prefix_cache"}`` (empties the engine's device prefix cache);
  ``{"op": "corrupt_primary"}`` (test-only negative control: negates every float of
  the worker's primary copy, so a later load brings back wrong KV);
  ``{"op": "wait_for_files", "dir": str, "suffix": str, "count": int,
  "timeout_s": float}`` (waits until a secondary tier has written that many files).

The last stdout line starting with ``RESULT_MARKER`` carries
``{"runs": {label: {"tokens", "logprobs", "num_cached_tokens"}}, "seconds": {...}}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

RESULT_MARKER = "KVPEER_ENGINE_RESULT "
FLOAT32_SIGN_BYTE = 3  # little-endian float32: byte 3 holds the sign bit
FLOAT32_SIZE = 4


def build_llm(scenario: dict[str, Any]) -> Any:
    """An in-process ``vllm.LLM`` with the OffloadingConnector on kvpeer's CPU spec."""
    from vllm import LLM

    extra_config: dict[str, Any] = {
        "spec_name": scenario["spec_name"],
        "spec_module_path": "kvpeer.integrations.vllm.cpu_spec",
        "cpu_bytes_to_use": scenario["cpu_bytes_to_use"],
    }
    extra_config.update(scenario.get("extra_config", {}))
    return LLM(
        model=scenario["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        block_size=32,
        enable_prefix_caching=True,
        max_num_seqs=4,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "engine_id": scenario["engine_id"],
            "kv_connector_extra_config": extra_config,
        },
    )


def generate(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy tokens, their logprobs and the prompt tokens the engine did not compute."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logprobs=1,
    )
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    completion = output.outputs[0]
    tokens = [int(token) for token in completion.token_ids]
    logprobs = [
        float(step[token].logprob) for step, token in zip(completion.logprobs, tokens, strict=True)
    ]
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "num_cached_tokens": int(output.num_cached_tokens or 0),
    }


def negate_primary(worker: Any) -> int:
    """Flip the sign of every float32 in the CPU copy worker's primary (runs in the worker).

    ``worker`` is vLLM's worker object (``collective_rpc`` passes it); the copy worker
    is reached through the process's KV connector. Returns the bytes touched.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    from kvpeer.integrations.vllm.cpu_spec import CpuCopyOffloadingWorker

    del worker
    connector = get_kv_transfer_group()
    assert isinstance(connector, OffloadingConnector)
    assert connector.connector_worker is not None
    offloading_worker = connector.connector_worker.worker
    assert isinstance(offloading_worker, CpuCopyOffloadingWorker)
    touched = 0
    for primary in offloading_worker.primary_tensors:
        primary[:, FLOAT32_SIGN_BYTE::FLOAT32_SIZE] ^= -128  # int8 0x80: the sign bit
        touched += primary.numel()
    return touched


def wait_for_files(directory: str, suffix: str, count: int, timeout_s: float) -> int:
    """Wait until ``directory`` holds ``count`` files ending in ``suffix``; return the count."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = sum(1 for path in Path(directory).rglob(f"*{suffix}") if path.is_file())
        if found >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def run(scenario: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, run the steps, shut the engine down; the outcome as a dict."""
    started = time.monotonic()
    llm = build_llm(scenario)
    seconds: dict[str, float] = {"init": time.monotonic() - started}
    runs: dict[str, dict[str, Any]] = {}
    files: dict[str, int] = {}
    try:
        for index, step in enumerate(scenario["steps"]):
            step_started = time.monotonic()
            op = step["op"]
            if op == "generate":
                runs[step["label"]] = generate(llm, step["prompt"], step["max_tokens"])
            elif op == "reset_prefix_cache":
                if not llm.reset_prefix_cache():
                    raise RuntimeError("reset_prefix_cache refused (requests still running?)")
            elif op == "corrupt_primary":
                touched = llm.collective_rpc(negate_primary)
                if not any(touched):
                    raise RuntimeError("corrupt_primary found no primary bytes")
            elif op == "wait_for_files":
                found = wait_for_files(
                    step["dir"], step["suffix"], step["count"], step["timeout_s"]
                )
                files[step["dir"]] = found
            else:
                raise ValueError(f"unknown step op {op!r}")
            seconds[f"{index}:{step.get('label', op)}"] = time.monotonic() - step_started
    finally:
        # Lets the connector release its shared region (the worker unlinks what it created).
        llm.llm_engine.engine_core.shutdown()
    seconds["total"] = time.monotonic() - started
    return {"runs": runs, "files": files, "seconds": seconds}


if __name__ == "__main__":
    outcome = run(json.loads(sys.argv[1]))
    print(RESULT_MARKER + json.dumps(outcome), flush=True)
