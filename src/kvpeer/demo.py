"""``kvpeer demo``: two real vLLM engines share KV through kvpeer, and prove it.

Engine A (the producer, vLLM's default multiprocessing mode) and engine B (the
consumer, in-process so its kvpeer tier can be asked what it loaded) run the tiny
random Llama of :mod:`kvpeer.integrations.vllm.model` with the kvpeer tier on one
data plane (A names it ``"type": "kvpeer"``, registered by kvpeer's vLLM plugin; B
with ``"type": "KVPeerTier", "module_path": "kvpeer.integrations.vllm"``). Two
scenarios, one after the other on the same pair:

- ``pd``: A prefills a prompt for a ``remote_decoder`` id and holds its blocks;
  B decodes the same prompt with ``remote_prefiller`` naming A.
- ``symmetric``: A computes another prompt as an ordinary request and goes idle;
  B runs it with ``remote_kv_source`` naming A (kvpeer wakes A's idle engine to
  answer the lookups).

A's own run of each prompt is the local-only reference (a fresh engine computed
every token). A scenario passes when B's tokens equal it, logprobs within
``LOGPROB_TOLERANCE``, and B, which never saw the prompt, had its prompt's blocks
loaded from A: kvpeer's counters say how many blocks and bytes, and vLLM's
``num_cached_tokens`` how many prompt tokens B did not compute.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpeer.integrations.vllm.launcher import Generation
__all__ = ["DATA_PLANES", "DemoResult", "ScenarioResult", "judge", "render", "run_demo"]

DATA_PLANES = ("shm", "tcp", "nixl")
BLOCK_TOKENS = 32  # the runner's vLLM block size
LOGPROB_TOLERANCE = 1e-4
PEER_TIMEOUT_S = 20.0  # lookup / load / handshake timeouts of both tiers
SIGNAL_TIMEOUT_S = 600.0  # backstop only: a failed partner is stopped at once
MAX_PROMPT_TOKENS = 448  # the runner's max_model_len (512) less room to generate

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ScenarioResult:
    """One scenario's outcome: what B got from A and whether its output matches."""

    name: str
    outputs_match: bool
    tokens_from_peer: int
    prompt_tokens: int
    bytes_from_peer: int
    blocks_from_peer: int
    data_plane: str
    ttft_local_s: float | None
    ttft_pulled_s: float | None
    load_seconds: float | None
    transfer_gbps: float | None
    max_logprob_delta: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class DemoResult:
    scenarios: list[ScenarioResult]
    data_plane: str
    model: str
    seconds: float
    logs: list[str]

    @property
    def ok(self) -> bool:
        return bool(self.scenarios) and all(s.ok for s in self.scenarios)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "data_plane": self.data_plane,
            "model": self.model,
            "seconds": round(self.seconds, 1),
            "logs": self.logs,
            "scenarios": [asdict(s) for s in self.scenarios],
        }


def default_model_dir(cache_home: str | None = None) -> Path:
    """Where the demo keeps its tiny checkpoint between runs (``$XDG_CACHE_HOME``)."""
    return Path(cache_home or Path.home() / ".cache") / "kvpeer" / "tiny-llama"


def run_demo(
    *,
    data_plane: str = "shm",
    prompt_tokens: int = 256,
    model_dir: Path,
    log_dir: Path | None = None,
    progress: Progress = lambda _: None,
) -> DemoResult:
    """Run both scenarios on one pair of engines; raise if an engine fails."""
    from kvpeer.errors import ConfigError

    if data_plane not in DATA_PLANES:
        raise ConfigError(f"data plane {data_plane!r}: choose one of {', '.join(DATA_PLANES)}")
    if not BLOCK_TOKENS * 2 <= prompt_tokens <= MAX_PROMPT_TOKENS:
        raise ConfigError(
            f"prompt tokens {prompt_tokens}: must be {BLOCK_TOKENS * 2}..{MAX_PROMPT_TOKENS}"
        )
    _require(data_plane)
    from kvpeer.integrations.vllm import scenario as sc
    from kvpeer.integrations.vllm.launcher import EngineLauncher, free_port
    from kvpeer.integrations.vllm.model import ensure_tiny_llama

    started = time.monotonic()
    progress(f"model: {model_dir} (created on first use)")
    model = ensure_tiny_llama(model_dir)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-demo-"))
    logs.mkdir(parents=True, exist_ok=True)
    launcher = EngineLauncher(model, logs, jobs=1)
    try:
        producer_port, consumer_port = free_port(), free_port()
        pd_id, sym_id = sc.request_id("demo-pd"), sc.request_id("demo-sym")
        pd_prompt, sym_prompt = sc.prompt(1, prompt_tokens), sc.prompt(2, prompt_tokens)
        signals = {name: str(logs / f"{name}.signal") for name in ("a1", "b1", "a2", "b2")}
        producer = sc.engine_scenario(
            launcher.model,
            launcher.new_engine_id("kvpeer-demo-a"),
            sc.kvpeer_tier(producer_port, data_plane, PEER_TIMEOUT_S, short_name=True),
            [
                sc.warmup(),
                sc.generate("pd-local", pd_prompt, sc.remote_decoder(pd_id)),
                sc.signal(signals["a1"]),
                sc.hold_until("serving-pd", signals["b1"], SIGNAL_TIMEOUT_S),
                sc.generate("symmetric-local", sym_prompt),
                sc.signal(signals["a2"]),
                sc.hold_until("serving-symmetric", signals["b2"], SIGNAL_TIMEOUT_S),
            ],
        )
        consumer = sc.engine_scenario(
            launcher.model,
            launcher.new_engine_id("kvpeer-demo-b"),
            sc.kvpeer_tier(consumer_port, data_plane, PEER_TIMEOUT_S),
            [
                sc.warmup(),
                sc.hold_until("waiting-pd", signals["a1"], SIGNAL_TIMEOUT_S),
                sc.generate(
                    "pd-pulled",
                    pd_prompt,
                    sc.remote_source("remote_prefiller", pd_id, producer_port),
                ),
                sc.signal(signals["b1"]),
                sc.hold_until("waiting-symmetric", signals["a2"], SIGNAL_TIMEOUT_S),
                sc.generate(
                    "symmetric-pulled",
                    sym_prompt,
                    sc.remote_source("remote_kv_source", sym_id, producer_port),
                ),
                sc.signal(signals["b2"]),
            ],
        )
        progress(f"starting engine A (producer) and engine B (consumer), data plane {data_plane}")
        a, b = launcher.run_together(
            [(producer, True), (consumer, False)],
            progress=progress,
            names=("A", "B"),
        )
    finally:
        launcher.close()
    scenarios = [
        judge(name, data_plane, prompt_tokens, a.runs[f"{name}-local"], b.runs[f"{name}-pulled"])
        for name in ("pd", "symmetric")
    ]
    log_paths = [str(o.log_path) for o in (a, b) if o.log_path is not None]
    if log_dir is None and all(s.ok for s in scenarios):
        shutil.rmtree(logs, ignore_errors=True)
        log_paths = []
    return DemoResult(scenarios, data_plane, str(model), time.monotonic() - started, log_paths)


def _require(data_plane: str) -> None:
    """Fail before any work if vLLM (or NIXL for its plane) is missing. Only looks for
    vLLM: importing it here would cost seconds, and only the engine processes use it."""
    import importlib.util

    from kvpeer.errors import ConfigError
    from kvpeer.integrations.vllm import VLLM_INSTALL_HINT

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"kvpeer demo: {VLLM_INSTALL_HINT}")
    if data_plane == "nixl":
        from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend

        if not NixlBackend.available():
            raise ConfigError(f"data plane nixl: {INSTALL_HINT}")


def judge(
    name: str, data_plane: str, prompt_tokens: int, local: Generation, pulled: Generation
) -> ScenarioResult:
    """Compare B's pulled run with A's local one and check B loaded the prompt from A."""
    problems: list[str] = []
    same_tokens = pulled.tokens == local.tokens
    delta = pulled.max_logprob_delta(local) if same_tokens else float("inf")
    if not same_tokens:
        problems.append(f"tokens differ: pulled {pulled.tokens} vs local {local.tokens}")
    elif delta > LOGPROB_TOLERANCE:
        problems.append(f"logprobs differ by up to {delta:.2e} (> {LOGPROB_TOLERANCE})")
    if local.num_cached_tokens != 0:
        problems.append(f"the local reference reused {local.num_cached_tokens} cached tokens")
    blocks = int(pulled.blocks_from_peer or 0)
    loaded_bytes = int(pulled.bytes_from_peer or 0)
    from_peer = min(pulled.num_cached_tokens, blocks * BLOCK_TOKENS)
    if from_peer < prompt_tokens - BLOCK_TOKENS:
        problems.append(
            f"only {from_peer} of {prompt_tokens} prompt tokens came from the peer "
            f"({blocks} blocks loaded, {pulled.num_cached_tokens} tokens cached)"
        )
    seconds = pulled.load_seconds
    gbps = loaded_bytes / seconds / 1e9 if seconds else None
    return ScenarioResult(
        name=name,
        outputs_match=same_tokens and delta <= LOGPROB_TOLERANCE,
        tokens_from_peer=from_peer,
        prompt_tokens=prompt_tokens,
        bytes_from_peer=loaded_bytes,
        blocks_from_peer=blocks,
        data_plane=data_plane,
        ttft_local_s=local.ttft_s,
        ttft_pulled_s=pulled.ttft_s,
        load_seconds=seconds,
        transfer_gbps=gbps,
        max_logprob_delta=delta,
        problems=problems,
    )


def render(result: DemoResult) -> str:
    """The result as a table, then one verdict line (and any problems)."""
    header = (
        f"{'scenario':<10} {'from peer':>11} {'bytes':>10} {'rate':>11} "
        f"{'TTFT local':>11} {'TTFT pulled':>12} {'plane':>6} {'outputs':>8}"
    )
    lines = [header, "-" * len(header)]
    for s in result.scenarios:
        rate = _rate(s.transfer_gbps)
        lines.append(
            f"{s.name:<10} {f'{s.tokens_from_peer}/{s.prompt_tokens} tok':>11} "
            f"{_size(s.bytes_from_peer):>10} {rate:>11} {_secs(s.ttft_local_s):>11} "
            f"{_secs(s.ttft_pulled_s):>12} {s.data_plane:>6} "
            f"{'match' if s.outputs_match else 'DIFFER':>8}"
        )
    lines.append("")
    for s in result.scenarios:
        lines.extend(f"{s.name}: {problem}" for problem in s.problems)
    verdict = "ok" if result.ok else "FAILED"
    lines.append(
        f"kvpeer demo {verdict}: {len(result.scenarios)} scenarios in {result.seconds:.0f} s "
        f"(tiny random Llama: pulling is not faster than computing it; the point is the bytes)"
    )
    if result.logs:
        lines.append("engine logs: " + " ".join(result.logs))
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _rate(gbps: float | None) -> str:
    if gbps is None:
        return "-"
    return f"{gbps:.2f} GB/s" if gbps >= 1 else f"{gbps * 1000:.0f} MB/s"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"
