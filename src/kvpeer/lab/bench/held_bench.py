"""``kvpeer bench held``: a pull from an idle producer, held blocks vs the serve window.

Two ``vllm serve`` engines with the kvpeer tier (``shm``) behind ``kvpeer router`` in
shared mode with pinning: ``a`` keeps ``held_bytes`` of copies (``kvpeer.node.held``)
and answers peers from them on its driver thread; ``b`` has none, so every peer
request waits for its engine's serve window (today's path). Both directions run in
the same run, alternating, each prompt fresh:

1. the producer computes the prompt (pinned with ``X-Kvpeer-Engine``): *computed*;
2. once the router has heard from the producer's KV events that it holds the prompt,
   the producer serves it again from its own cache: *local hit*;
3. after ``idle_s`` (both engines idle), the other engine serves it: the router names
   the producer as the source (``X-Kvpeer-Source``) and the engine pulls: *pulled*.

Times are time to first token at the client (streamed), medians per producer. The
pulled/local ratio is what the issue is about (a pull as cheap as a local hit); the
held/serve-window ratio of the pulled medians is the gain of held blocks. The
consumer differs between directions (``b`` pulls from ``a``, ``a`` from ``b``), but
the engines are identical, so it is the producer's path that differs.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HeldSpec", "render", "run"]

Progress = Callable[[str], None]
HELD, WINDOW = "held", "serve-window"
METRICS_FLUSH_S = 3.0  # vLLM publishes a tier's stats with its next stats flush


@dataclass(frozen=True)
class HeldSpec:
    prompts: int = 5
    prompt_tokens: int = 1536
    idle_s: float = 1.0
    held_bytes: int = 128 << 20


def run(
    spec: HeldSpec, model_dir: Path, progress: Progress, log_dir: Path | None = None
) -> dict[str, Any]:
    from kvpeer.lab.demo_run import (
        LOGPROB_TOLERANCE,
        MODEL_NAME,
        VOCAB,
        _pin,
        _wait_indexed,
        shared_pinned_config,
    )
    from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama
    from kvpeer.lab.engines.openai_client import OpenAIClient
    from kvpeer.lab.engines.serving import ServeFleet, ServeSpec
    from kvpeer.router.background import BackgroundRouter

    model = ensure_llama(model_dir, SERVE_LLAMA_CONFIG)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-bench-held-"))
    a = ServeSpec("a", model, data_plane="shm", tier_options={"held_bytes": spec.held_bytes})
    b = ServeSpec("b", model, data_plane="shm")
    rng = random.Random(20261203)

    def fresh() -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(spec.prompt_tokens)]

    samples: dict[str, dict[str, list[float]]] = {
        path: {"computed": [], "local": [], "pulled": []} for path in (HELD, WINDOW)
    }
    sources: dict[str, list[str | None]] = {HELD: [], WINDOW: []}
    same = {HELD: 0, WINDOW: 0}  # pulls whose output equals the producer's own
    fleet = ServeFleet(logs, progress)
    ok = False
    try:
        progress(f"starting two vllm serve engines: a (held_bytes {spec.held_bytes}), b (none)")
        fleet.start([a, b])
        with BackgroundRouter(shared_pinned_config(a, b)) as router:
            client = OpenAIClient(router.url, MODEL_NAME)
            try:
                progress("warm-up: each engine computes once and pulls once")
                for producer, consumer in (("a", "b"), ("b", "a")):
                    warm = fresh()
                    client.complete(warm, 2, _pin(producer))
                    _wait_indexed(router, producer, warm)
                    client.complete(warm, 2, _pin(consumer))
                urls = {"a": a.url, "b": b.url}
                waits = {p: _serve_waits(url) for p, url in urls.items()}
                for n in range(spec.prompts):
                    for path, producer, consumer in ((HELD, "a", "b"), (WINDOW, "b", "a")):
                        prompt = fresh()
                        got = samples[path]
                        got["computed"].append(client.complete(prompt, 2, _pin(producer)).ttft_s)
                        _wait_indexed(router, producer, prompt)
                        local = client.complete(prompt, 2, _pin(producer))
                        got["local"].append(local.ttft_s)
                        time.sleep(spec.idle_s)
                        pulled = client.complete(prompt, 2, _pin(consumer))
                        got["pulled"].append(pulled.ttft_s)
                        sources[path].append(pulled.headers.get("x-kvpeer-source"))
                        same[path] += pulled.tokens == local.tokens and (
                            pulled.max_logprob_delta(local) <= LOGPROB_TOLERANCE
                        )
                        progress(
                            f"prompt {n + 1}/{spec.prompts} {path}: pulled "
                            f"{pulled.ttft_s * 1000:.0f} ms from {sources[path][-1]}"
                        )
                time.sleep(METRICS_FLUSH_S)
                windows = {
                    HELD: _serve_waits(urls["a"]) - waits["a"],
                    WINDOW: _serve_waits(urls["b"]) - waits["b"],
                }
            finally:
                client.close()
        ok = True
    finally:
        fleet.close()
        if ok and log_dir is None:
            shutil.rmtree(logs, ignore_errors=True)
    return summarize(spec, samples, sources, windows, same)


def _serve_waits(url: str) -> float:
    """Serve windows in which the engine at ``url`` answered peer work, since start
    (``peer_step_wait_seconds`` observes one per window that served a waiting peer)."""
    from kvpeer.lab.engines.serving import kvpeer_samples

    return kvpeer_samples(url).get("peer_step_wait_seconds_count", 0.0)


def summarize(
    spec: HeldSpec,
    samples: dict[str, dict[str, list[float]]],
    sources: dict[str, list[str | None]],
    windows: dict[str, float],
    same: dict[str, int],
) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for path, got in samples.items():
        row = {name: statistics.median(values) if values else None for name, values in got.items()}
        expected = "a" if path == HELD else "b"
        row["pulled_from_producer"] = sum(1 for s in sources[path] if s == expected)
        row["producer_serve_windows"] = windows[path]
        row["same_output"] = same[path]
        row["pulled_over_local"] = (
            row["pulled"] / row["local"] if row["pulled"] and row["local"] else None
        )
        rows[path] = row
    held, window = rows[HELD]["pulled"], rows[WINDOW]["pulled"]
    return {
        "spec": vars(spec),
        "rows": rows,
        "held_over_window": held / window if held and window else None,
        "samples": samples,
    }


def render(result: dict[str, Any]) -> str:
    spec = result["spec"]
    lines = [
        f"kvpeer bench held: {spec['prompts']} fresh {spec['prompt_tokens']}-token prompts per "
        f"path, idle {spec['idle_s']:g} s before each pull; TTFT medians (ms)",
        f"{'producer path':<14} {'computed':>9} {'local hit':>10} {'pulled':>8} "
        f"{'pulled/local':>13} {'from producer':>14} {'serve windows':>14} {'same output':>12}",
    ]
    for path, row in result["rows"].items():
        lines.append(
            f"{path:<14} {_ms(row['computed']):>9} {_ms(row['local']):>10} "
            f"{_ms(row['pulled']):>8} {_x(row['pulled_over_local']):>13} "
            f"{row['pulled_from_producer']:>14} {row['producer_serve_windows']:>14.0f} "
            f"{row['same_output']:>12}"
        )
    lines.append(f"pulled, held / serve-window: {_x(result['held_over_window'])}")
    lines.append(
        "same output: pulls whose tokens and logprobs equal the producer's local hit; "
        + "serve windows: the producer's engine steps that answered a peer during the "
        "measured pulls (0: every pull was served from held blocks)"
    )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
