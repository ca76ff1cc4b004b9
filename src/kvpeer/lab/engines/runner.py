"""Run one vLLM engine scenario and print its outcome as one JSON line.

Usage: ``python -m kvpeer.lab.engines.runner '<scenario json>'``. ``kvpeer demo``
and the real-vLLM tests run it as a subprocess (:mod:`kvpeer.lab.engines.launcher`)
because vLLM on CPU forces the ``spawn`` start method and keeps process-wide state.
The scenario is a JSON object:

- ``model``: checkpoint directory; ``engine_id``: the connector's ``engine_id``
  (names ``/dev/shm/vllm_offload_<engine_id>.mmap``); ``spec_name``: an offloading
  spec of :mod:`kvpeer.integrations.vllm.cpu_spec`; ``cpu_bytes_to_use``;
  optional ``extra_config``: more ``kv_connector_extra_config`` keys (e.g.
  ``secondary_tiers``, ``blocks_per_chunk``).
- ``steps``, run in order:
  ``{"op": "generate", "label": str, "prompt": [token ids], "max_tokens": int}``, with
  optional ``"kv_transfer_params"`` (the request's routing, passed as
  ``SamplingParams(extra_args={"kv_transfer_params": ...})``);
  ``{"op": "reset_prefix_cache"}`` (empties the engine's device prefix cache);
  ``{"op": "corrupt_primary"}`` (a negative control for tests: negates every float of
  the worker's primary copy, so a later load brings back wrong KV);
  ``{"op": "wait_for_files", "dir": str, "suffix": str, "count": int,
  "timeout_s": float}`` (waits until a secondary tier has written that many files);
  ``{"op": "signal", "file": str, "text": str}`` (writes ``file`` atomically, so another
  process knows this engine got here);
  ``{"op": "hold", "label": str, "until_file": str, "timeout_s": float}`` (keeps the
  engine alive, not stepping it, until ``file`` exists; fails after ``timeout_s``) or
  ``{"op": "hold", "label": str, "seconds": float}`` (a fixed idle time). A hold
  records how long it waited and the CPU time this engine's processes (its process
  group: in multiprocessing mode also the EngineCore and the worker) used meanwhile,
  in all and by process name.

The last stdout line starting with ``RESULT_MARKER`` carries ``{"runs": {label:
{"tokens", "logprobs", "num_cached_tokens", "seconds", "cpu_seconds", "ttft_s",
"blocks_from_peer", "bytes_from_peer", "load_seconds"}}, "holds":
{label: {"seconds", "cpu_seconds", "cpu_seconds_by_process"}}, "files": {...},
"seconds": {...}, "longest_stall_s": float}``; then the process exits at once. ``ttft_s`` is vLLM's
time to first token (engine-core clock); ``blocks_from_peer`` / ``bytes_from_peer`` /
``load_seconds`` count what kvpeer tiers of this process loaded from peers during the
call, and how long those loads took from fetch to completion (``null``
in multiprocessing mode, where the tier lives in the EngineCore process).
``longest_stall_s`` is the longest stretch in which this process did not run at all
(:class:`FreezeWatch`): a machine that stalls every process for ~10 s expires ZMQ's
heartbeats between healthy engines.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

RESULT_MARKER = "KVPEER_ENGINE_RESULT "
STEP_MARKER = "KVPEER_ENGINE_STEP "  # then what the engine does now (progress for launchers)
FLOAT32_SIGN_BYTE = 3  # little-endian float32: byte 3 holds the sign bit
FLOAT32_SIZE = 4


def build_llm(scenario: dict[str, Any]) -> Any:
    """An in-process ``vllm.LLM`` with the offloading connector on kvpeer's CPU spec:
    kvpeer's own connector when a kvpeer tier is configured, vLLM's otherwise (vLLM's
    p2p tier and the CPU tier alone run as vLLM ships them)."""
    from vllm import LLM

    extra_config: dict[str, Any] = {
        "spec_name": scenario["spec_name"],
        "spec_module_path": "kvpeer.integrations.vllm.cpu_spec",
        "cpu_bytes_to_use": scenario["cpu_bytes_to_use"],
    }
    extra_config.update(scenario.get("extra_config", {}))
    tiers = extra_config.get("secondary_tiers", ())
    kvpeer = any(tier.get("type") in ("KVPeerTier", "kvpeer") for tier in tiers)
    connector: dict[str, Any] = (
        {"kv_connector": "KVPeerOffloadingConnector",
         "kv_connector_module_path": "kvpeer.integrations.vllm.connector"}
        if kvpeer else {"kv_connector": "OffloadingConnector"}
    )  # fmt: skip
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
        disable_log_stats=False,  # per-request metrics: the time to first token
        kv_transfer_config={
            **connector,
            "kv_role": "kv_both",
            "engine_id": scenario["engine_id"],
            "kv_connector_extra_config": extra_config,
        },
    )


def generate(
    llm: Any,
    prompt: list[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Greedy tokens, their logprobs, the prompt tokens the engine did not compute, and
    the wall and CPU seconds (of this engine's processes) the ``generate`` call took."""
    from vllm import SamplingParams, TokensPrompt

    extra_args = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logprobs=1,
        extra_args=extra_args,
    )
    cpu_before = group_cpu_seconds()
    loaded_before = blocks_loaded()
    sync_before = sync_counts(llm)
    started = time.monotonic()
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    seconds = time.monotonic() - started
    cpu_seconds = group_cpu_seconds() - cpu_before
    loaded_after = blocks_loaded()
    sync_after = sync_counts(llm)
    completion = output.outputs[0]
    tokens = [int(token) for token in completion.token_ids]
    logprobs = [
        float(step[token].logprob) for step, token in zip(completion.logprobs, tokens, strict=True)
    ]
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "num_cached_tokens": int(output.num_cached_tokens or 0),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "ttft_s": _first_token_latency(output),
        "blocks_from_peer": _delta(loaded_after, loaded_before, 0),
        "bytes_from_peer": _delta(loaded_after, loaded_before, 1),
        "load_seconds": _delta(loaded_after, loaded_before, 2),
        **{
            name: None if sync_after is None or sync_before is None
            else sync_after[name] - sync_before[name]
            for name in SYNC_COUNTS
        },
    }


SYNC_COUNTS = ("engine_steps", "sync_promotions", "late_promotions", "sync_loads")


def sync_counts(llm: Any) -> dict[str, int] | None:
    """Scheduler steps, and the promotions and loads kvpeer's manager and connector made
    without extra steps, so far; ``None`` unless the scheduler runs in this process."""
    from kvpeer.integrations.vllm.connector import KVPeerOffloadingConnector
    from kvpeer.integrations.vllm.manager import KVPeerTieringManager
    from kvpeer.integrations.vllm.secondary_tier import live_tiers

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process only
    connector = getattr(getattr(core, "scheduler", None), "connector", None)
    tiers = live_tiers()
    if not isinstance(connector, KVPeerOffloadingConnector) or len(tiers) != 1:
        return None
    assert connector.connector_scheduler is not None
    manager = connector.connector_scheduler.manager
    assert isinstance(manager, KVPeerTieringManager)
    return {
        "engine_steps": tiers[0].node.tier.steps,
        "sync_promotions": manager.sync_promotions,
        "late_promotions": manager.late_promotions,
        "sync_loads": connector.sync_loads,
    }


def blocks_loaded() -> tuple[float, float, float] | None:
    """Blocks, bytes and load seconds of what the kvpeer tiers of this process loaded
    from peers so far; ``None`` if none lives here (multiprocessing mode, no kvpeer)."""
    from kvpeer.integrations.vllm.secondary_tier import live_tiers

    tiers = live_tiers()
    if not tiers:
        return None
    blocks = [tier.node.tier.blocks_loaded for tier in tiers]
    return (
        sum(blocks),
        sum(n * tier.block_len for n, tier in zip(blocks, tiers, strict=True)),
        sum(tier.node.tier.load_seconds for tier in tiers),
    )


def _delta(
    after: tuple[float, float, float] | None, before: tuple[float, float, float] | None, index: int
) -> float | None:
    if after is None or before is None:
        return None
    return after[index] - before[index]


def _first_token_latency(output: Any) -> float | None:
    metrics = getattr(output, "metrics", None)
    latency = getattr(metrics, "first_token_latency", None)
    return float(latency) if latency else None


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


def write_signal(path: str, text: str) -> None:
    """Write ``path`` so that a reader never sees it half written."""
    partial = f"{path}.{os.getpid()}.partial"
    Path(partial).write_text(text, encoding="utf-8")
    os.replace(partial, path)


def group_cpu() -> dict[int, tuple[str, float]]:
    """``pid -> (name, user + system CPU seconds)`` of the processes of this process
    group (vLLM names its processes, e.g. ``VLLM::EngineCore``)."""
    group = os.getpgrp()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    found: dict[int, tuple[str, float]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process exited meanwhile
            continue
        name, _, rest = text.partition(" (")[2].rpartition(")")
        fields = rest.split()  # state ppid pgrp ... utime (11) stime (12)
        if int(fields[2]) == group:
            found[int(stat.parent.name)] = (name, (int(fields[11]) + int(fields[12])) * tick)
    return found


def group_cpu_seconds() -> float:
    """User + system CPU seconds of the live processes of this process group."""
    return sum(seconds for _, seconds in group_cpu().values())


def hold(step: dict[str, Any]) -> dict[str, Any]:
    """Keep the engine alive without stepping it, for a time or until a file appears."""
    cpu_before = group_cpu()
    started = time.monotonic()
    until_file = step.get("until_file")
    if until_file is None:
        time.sleep(float(step["seconds"]))
    else:
        deadline = started + float(step["timeout_s"])
        while not os.path.exists(until_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"hold: {until_file} did not appear in {step['timeout_s']} s")
            time.sleep(0.02)
    seconds = time.monotonic() - started
    by_process: dict[str, float] = {}
    for pid, (name, cpu) in group_cpu().items():
        used = cpu - cpu_before.get(pid, (name, 0.0))[1]
        by_process[name] = by_process.get(name, 0.0) + used
    return {
        "seconds": seconds,
        "cpu_seconds": sum(by_process.values()),
        "cpu_seconds_by_process": by_process,
    }


class FreezeWatch:
    """The longest time this process went unscheduled while in the block: a thread asks
    to wake every ``tick_s`` and records how late it woke."""

    def __init__(self, tick_s: float = 0.05) -> None:
        self._tick = tick_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="freeze-watch", daemon=True)
        self.longest_s = 0.0

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            self.longest_s = max(self.longest_s, now - last - self._tick)
            last = now

    def start(self) -> FreezeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> FreezeWatch:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def announce(what: str) -> None:
    """Tell a launcher following this engine's output what it does now."""
    print(STEP_MARKER + what, flush=True)


def run(scenario: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, run the steps, shut the engine down; the outcome as a dict."""
    started = time.monotonic()
    announce("starting vLLM")
    if any(step["op"] == "corrupt_primary" for step in scenario["steps"]):
        # In multiprocessing mode collective_rpc sends the function to the EngineCore
        # over msgpack, which takes a function only with pickle allowed (this engine's
        # own processes only; nothing from outside reaches that channel).
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = build_llm(scenario)
    seconds: dict[str, float] = {"init": time.monotonic() - started}
    runs: dict[str, dict[str, Any]] = {}
    holds: dict[str, dict[str, Any]] = {}
    files: dict[str, int] = {}
    watch = FreezeWatch().start()  # the steps, not vLLM's start-up
    try:
        for index, step in enumerate(scenario["steps"]):
            step_started = time.monotonic()
            op = step["op"]
            announce(f"{op} {step.get('label', '')}".strip())
            if op == "generate":
                runs[step["label"]] = generate(
                    llm, step["prompt"], step["max_tokens"], step.get("kv_transfer_params")
                )
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
            elif op == "signal":
                write_signal(step["file"], step.get("text", ""))
            elif op == "hold":
                holds[step["label"]] = hold(step)
            else:
                raise ValueError(f"unknown step op {op!r}")
            seconds[f"{index}:{step.get('label', op)}"] = time.monotonic() - step_started
    finally:
        # Lets the connector release its shared region (the worker unlinks what it created).
        llm.llm_engine.engine_core.shutdown()
        watch.stop()
    seconds["total"] = time.monotonic() - started
    return {
        "runs": runs,
        "holds": holds,
        "files": files,
        "seconds": seconds,
        "longest_stall_s": watch.longest_s,
    }


if __name__ == "__main__":
    outcome = run(json.loads(sys.argv[1]))
    print(RESULT_MARKER + json.dumps(outcome), flush=True)
    sys.stderr.flush()
    # The engine is shut down (``run``); what is left is the interpreter's teardown of
    # torch and vLLM, 2-3 s with or without a secondary tier, and longer on a busy
    # machine: every engine a test waits for would pay it.
    os._exit(0)
