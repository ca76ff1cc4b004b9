"""``kvpeer demo``: two ``vllm serve`` engines behind ``kvpeer router`` share KV, over HTTP.

The demo runs what an operator runs: two vLLM OpenAI servers (engines ``a`` and ``b``,
each with the kvpeer tier and vLLM's KV event publisher) and two routers in front of
them (``pd``: ``a`` prefills, ``b`` decodes; ``shared``: both serve whole requests and
the router picks a peer to pull from, from the engines' own KV events). Requests go
through the routers with the official ``openai`` client, streamed. Three scenarios:

- ``pd``: a fresh prompt through the PD router. ``a`` runs the prefill leg, ``b`` pulls
  every block and decodes. The pulled TTFT is ``b``'s part (the client's TTFT less the
  prefill leg, which the router reports in ``X-Kvpeer-Prefill-Seconds``).
- ``shared``: a fresh prompt served by ``a`` (it computes every token: the local TTFT),
  then the same prompt served by ``b``: the router sees that ``a`` holds it in its CPU
  tier and names ``a`` in ``remote_kv_source``; ``b`` pulls instead of computing.
- ``chat``: turn one of a conversation on ``a``; turn two (turn one, the answer, a new
  message) lands on ``b``, which pulls the conversation so far from ``a``.

Placement (which engine serves) is pinned with ``X-Kvpeer-Engine`` (the shared router
runs with ``allow_pinning``) so every scenario shows the case it is about; where to pull
from is always the router's own decision. The local TTFT of ``pd`` and ``chat`` is a
fresh prompt of the same length computed by the serving engine, measured in the same
run. A scenario passes when the output equals the reference (the same request computed
without pulling), token for token with logprobs within ``LOGPROB_TOLERANCE``, and the
serving engine took the prompt from its peer: the router named the peer, vLLM's
``cached_tokens`` covers the prompt's blocks (the engine never saw the prompt), and
kvpeer's own ``vllm:kvpeer_pulled_*`` counters on the engine's ``/metrics`` moved.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpeer.lab.engines.openai_client import Completion
    from kvpeer.router.background import BackgroundRouter

__all__ = [
    "DATA_PLANES",
    "DemoResult",
    "ScenarioResult",
    "default_model_dir",
    "judge",
    "render",
    "run_demo",
]

DATA_PLANES = ("shm", "tcp", "nixl")
BLOCK_TOKENS = 32  # the engines' vLLM block size
LOGPROB_TOLERANCE = 1e-4
OUTPUT_TOKENS = 8
DEFAULT_PROMPT_TOKENS = 1536
MAX_PROMPT_TOKENS = 1536  # the model's 2,048 positions less the chat's second turn
CHAT_NEXT_TOKENS = 256  # the second turn's new message
INDEX_WAIT_S = 15.0  # how long the router may take to hear of a's blocks
MODEL_NAME = "kvpeer-demo"
VOCAB = (3, 512)  # token ids past the tokenizer's special tokens

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ScenarioResult:
    """One scenario: what the serving engine got from its peer, and whether it matches."""

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
    api: str = "openai-http"
    speedup: float | None = None  # ttft_local_s / ttft_pulled_s
    source: str | None = None  # the peer the router named
    problems: list[str] = field(default_factory=list)
    #: the serving engine's tier: router prefetches it received during the request
    #: (pulling ahead, on by default), and blocks it took from staging
    prefetches: int = 0
    blocks_pulled_ahead: int = 0
    #: blocks the source's tier held a copy of after the request (held blocks, default)
    source_held_blocks: int | None = None

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


@dataclass(frozen=True)
class PeerCounters:
    """kvpeer's counters on one engine's ``/metrics`` (``vllm:kvpeer_*``)."""

    blocks: float = 0.0
    bytes: float = 0.0
    fetch_seconds: float = 0.0
    prefetches: float = 0.0  # pull_ahead_total{event="prefetches"}
    ahead_blocks: float = 0.0  # pull_ahead_total{event="blocks_used"}
    held_blocks: float = 0.0  # a gauge: kept as it is now by a difference

    def __sub__(self, other: PeerCounters) -> PeerCounters:
        return PeerCounters(
            self.blocks - other.blocks,
            self.bytes - other.bytes,
            self.fetch_seconds - other.fetch_seconds,
            self.prefetches - other.prefetches,
            self.ahead_blocks - other.ahead_blocks,
            self.held_blocks,
        )


@dataclass(frozen=True)
class Pulled:
    """The serving engine's run that should have pulled, with what proves it did."""

    completion: Completion
    ttft_s: float  # the serving engine's part of the client's TTFT
    source: str | None  # the peer the router named (X-Kvpeer-Source)
    counters: PeerCounters  # kvpeer's counters on the serving engine, this run only


def default_model_dir(cache_home: str | None = None, name: str = "serve-llama") -> Path:
    """Where the demo (``serve-llama``) and ``kvpeer bench idle`` (``tiny-llama``) keep
    their checkpoints between runs (under ``$XDG_CACHE_HOME``)."""
    return Path(cache_home or Path.home() / ".cache") / "kvpeer" / name


def run_demo(
    *,
    data_plane: str = "shm",
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    model_dir: Path,
    log_dir: Path | None = None,
    progress: Progress = lambda _: None,
) -> DemoResult:
    """Run the three scenarios on one pair of engines; raise if an engine fails."""
    from kvpeer.errors import ConfigError

    if data_plane not in DATA_PLANES:
        raise ConfigError(f"data plane {data_plane!r}: choose one of {', '.join(DATA_PLANES)}")
    if not BLOCK_TOKENS * 2 <= prompt_tokens <= MAX_PROMPT_TOKENS:
        raise ConfigError(
            f"prompt tokens {prompt_tokens}: must be {BLOCK_TOKENS * 2}..{MAX_PROMPT_TOKENS}"
        )
    _require(data_plane)
    from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama
    from kvpeer.lab.engines.serving import ServeFleet, ServeSpec

    started = time.monotonic()
    progress(f"model: {model_dir} (created on first use)")
    model = ensure_llama(model_dir, SERVE_LLAMA_CONFIG)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-demo-"))
    specs = [ServeSpec(name, model, data_plane=data_plane) for name in ("a", "b")]
    fleet = ServeFleet(logs, progress)
    scenarios: list[ScenarioResult] = []
    try:
        progress(f"starting two vllm serve engines (kvpeer tier, data plane {data_plane})")
        fleet.start(specs)
        scenarios = _run_scenarios(specs, data_plane, prompt_tokens, progress)
    finally:
        fleet.close()
    log_paths = [str(engine.log_path) for engine in fleet.engines.values()]
    if log_dir is None and scenarios and all(s.ok for s in scenarios):
        shutil.rmtree(logs, ignore_errors=True)
        log_paths = []
    return DemoResult(scenarios, data_plane, str(model), time.monotonic() - started, log_paths)


def _run_scenarios(
    specs: list[Any], data_plane: str, prompt_tokens: int, progress: Progress
) -> list[ScenarioResult]:
    from kvpeer.lab.engines.model import token_text
    from kvpeer.lab.engines.openai_client import OpenAIClient
    from kvpeer.router.background import BackgroundRouter
    from kvpeer.router.config import RouterConfig
    from kvpeer.router.policy import Mode, Role

    a, b = specs
    shared_config = shared_pinned_config(a, b)
    pd_config = RouterConfig(
        Mode.PD,
        (_entry(a.router_engine(Role.PREFILL)), _entry(b.router_engine(Role.DECODE))),
        listen_port=0,
    )
    rng = random.Random(20261201)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    with BackgroundRouter(shared_config) as shared, BackgroundRouter(pd_config) as pd:
        progress(f"routers: shared {shared.url}, pd {pd.url}")
        via_shared = OpenAIClient(shared.url, MODEL_NAME)
        via_pd = OpenAIClient(pd.url, MODEL_NAME)
        direct = {s.name: OpenAIClient(s.url, MODEL_NAME) for s in specs}
        try:
            progress("warm-up: each engine computes once and pulls once")
            for name in ("a", "b"):
                direct[name].complete(fresh(prompt_tokens), 2)
            warm = fresh(prompt_tokens)
            via_shared.complete(warm, 2, _pin("a"))
            _wait_indexed(shared, "a", warm)
            via_shared.complete(warm, 2, _pin("b"))
            via_pd.complete(fresh(prompt_tokens), 2)

            results = []
            progress("scenario pd: a prefills, b pulls every block and decodes")
            prompt = fresh(prompt_tokens)
            local = direct["b"].complete(fresh(prompt_tokens), OUTPUT_TOKENS)
            pulled = _pulled(b, lambda: via_pd.complete(prompt, OUTPUT_TOKENS))
            reference = direct["a"].complete(prompt, OUTPUT_TOKENS)
            results.append(judge("pd", data_plane, prompt_tokens, reference, local, pulled,
                                 source_held=_held_blocks(a.url)))

            progress("scenario shared: a computes a prompt, then b serves it from a's KV")
            prompt = fresh(prompt_tokens)
            text = token_text(prompt)  # a text prompt: the router asks /tokenize
            reference = via_shared.complete(text, OUTPUT_TOKENS, _pin("a"))
            _wait_indexed(shared, "a", prompt)
            pulled = _pulled(b, lambda: via_shared.complete(text, OUTPUT_TOKENS, _pin("b")))
            results.append(
                judge("shared", data_plane, prompt_tokens, reference, reference, pulled,
                      source_held=_held_blocks(a.url))
            )

            progress("scenario chat: turn one on a, turn two on b, pulling turn one from a")
            first = [{"role": "user", "content": token_text(fresh(prompt_tokens - 256))}]
            answer = via_shared.chat(first, OUTPUT_TOKENS, _pin("a"))
            second = [
                *first,
                {"role": "assistant", "content": token_text(answer.tokens)},
                {"role": "user", "content": token_text(fresh(CHAT_NEXT_TOKENS))},
            ]
            turn_two = prompt_tokens - 256 + len(answer.tokens) + CHAT_NEXT_TOKENS
            local = direct["b"].complete(fresh(turn_two), OUTPUT_TOKENS)
            _wait_indexed(shared, "a", _chat_tokens(first))
            pulled = _pulled(b, lambda: via_shared.chat(second, OUTPUT_TOKENS, _pin("b")))
            reference = direct["a"].chat(second, OUTPUT_TOKENS)
            results.append(judge("chat", data_plane, turn_two, reference, local, pulled,
                                 expected_from_peer=_chat_tokens(first),
                                 source_held=_held_blocks(a.url)))
            return results
        finally:
            for client in (via_shared, via_pd, *direct.values()):
                client.close()


def _entry(spec: Any) -> Any:
    from kvpeer.router.config import EngineEntry

    return EngineEntry(spec)


def shared_pinned_config(*specs: Any) -> Any:
    """A shared-mode router over these ``ServeSpec`` engines that honours pinning
    (``X-Kvpeer-Engine``) and listens on any free port."""
    from kvpeer.router.config import RouterConfig
    from kvpeer.router.policy import Mode

    entries = tuple(_entry(spec.router_engine()) for spec in specs)
    return RouterConfig(Mode.SHARED, entries, listen_port=0, allow_pinning=True)


def _pin(engine: str) -> dict[str, str]:
    from kvpeer.router.app import PIN_HEADER

    return {PIN_HEADER: engine}


def _chat_tokens(messages: list[dict[str, str]]) -> list[int]:
    """The chat template's prompt: the contents, each followed by a space (t<id> words)."""
    return [int(word[1:]) for m in messages for word in m["content"].split()]


def _wait_indexed(router: BackgroundRouter, engine: str, prompt: list[int]) -> None:
    """Wait (bounded) until the router has heard, from ``engine``'s own KV events, that
    its CPU tier holds ``prompt``'s blocks: until then it cannot name it as a source."""
    from kvpeer.router.index import MEDIUM_CPU

    index = router.router.index
    if index is None:
        return
    full = len(prompt) // BLOCK_TOKENS * BLOCK_TOKENS
    deadline = time.monotonic() + INDEX_WAIT_S
    while time.monotonic() < deadline:
        held = router.call(
            lambda: index.longest_prefix(engine, index.keys(prompt), MEDIUM_CPU, time.monotonic())
        )
        if held >= full - BLOCK_TOKENS:
            return
        time.sleep(0.05)


def _pulled(engine: Any, request: Callable[[], Completion]) -> Pulled:
    """Run ``request`` and read what kvpeer on ``engine`` pulled meanwhile."""
    before = _peer_counters(engine.url)
    completion = request()
    after = _settled_counters(engine.url, before)
    prefill = completion.headers.get("x-kvpeer-prefill-seconds")
    ttft = completion.ttft_s - float(prefill) if prefill else completion.ttft_s
    source = completion.headers.get("x-kvpeer-source")
    return Pulled(completion, ttft, source, after - before)


def _settled_counters(url: str, before: PeerCounters) -> PeerCounters:
    """The counters once vLLM has published the pull (its stats reach ``/metrics`` with
    the engine's next stats flush, within about a second)."""
    deadline = time.monotonic() + 5.0
    current = _peer_counters(url)
    while current.blocks == before.blocks and time.monotonic() < deadline:
        time.sleep(0.1)
        current = _peer_counters(url)
    return current


def _held_blocks(url: str) -> int:
    """Blocks the engine's kvpeer tier holds a copy of now."""
    return int(_peer_counters(url).held_blocks)


def _peer_counters(url: str) -> PeerCounters:
    from kvpeer.lab.engines.serving import kvpeer_samples

    found = kvpeer_samples(url)
    return PeerCounters(
        found.get("pulled_blocks_total", 0.0),
        found.get("pulled_bytes_total", 0.0),
        found.get("fetch_duration_seconds_sum", 0.0),
        found.get("pull_ahead_total[prefetches]", 0.0),
        found.get("pull_ahead_total[blocks_used]", 0.0),
        found.get("held_blocks", 0.0),
    )


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
    name: str,
    data_plane: str,
    prompt_tokens: int,
    reference: Completion,
    local: Completion,
    pulled: Pulled,
    *,
    expected_from_peer: list[int] | None = None,
    source_held: int | None = None,
) -> ScenarioResult:
    """Compare the pulled run with the reference and check it took the prompt from the
    peer. ``local`` is the serving engine computing a prompt of this length itself."""
    problems: list[str] = []
    run = pulled.completion
    same = run.tokens == reference.tokens and bool(run.tokens)
    delta = run.max_logprob_delta(reference) if same else float("inf")
    if not same:
        problems.append(f"tokens differ: pulled {run.tokens} vs reference {reference.tokens}")
    elif delta > LOGPROB_TOLERANCE:
        problems.append(f"logprobs differ by up to {delta:.2e} (> {LOGPROB_TOLERANCE})")
    if local.cached_tokens > BLOCK_TOKENS:
        problems.append(f"the local run reused {local.cached_tokens} cached tokens")
    if pulled.source is None:
        problems.append("the router named no peer to pull from")
    counters = pulled.counters
    from_peer = min(run.cached_tokens, int(counters.blocks) * BLOCK_TOKENS)
    want = len(expected_from_peer) if expected_from_peer is not None else prompt_tokens
    if from_peer < want - BLOCK_TOKENS:
        problems.append(
            f"only {from_peer} of {want} prompt tokens came from the peer "
            f"({int(counters.blocks)} blocks pulled, {run.cached_tokens} tokens cached)"
        )
    seconds = counters.fetch_seconds or None
    gbps = counters.bytes / seconds / 1e9 if seconds else None
    ttft_pulled = pulled.ttft_s
    return ScenarioResult(
        name=name,
        outputs_match=same and delta <= LOGPROB_TOLERANCE,
        tokens_from_peer=from_peer,
        prompt_tokens=prompt_tokens,
        bytes_from_peer=int(counters.bytes),
        blocks_from_peer=int(counters.blocks),
        data_plane=data_plane,
        ttft_local_s=local.ttft_s,
        ttft_pulled_s=ttft_pulled,
        load_seconds=seconds,
        transfer_gbps=gbps,
        max_logprob_delta=delta,
        speedup=local.ttft_s / ttft_pulled if ttft_pulled > 0 else None,
        source=pulled.source,
        problems=problems,
        prefetches=int(counters.prefetches),
        blocks_pulled_ahead=int(counters.ahead_blocks),
        source_held_blocks=source_held,
    )


def render(result: DemoResult) -> str:
    """The result as a table, then one verdict line (and any problems)."""
    header = (
        f"{'scenario':<8} {'from peer':>13} {'bytes':>10} {'rate':>11} {'TTFT local':>11} "
        f"{'TTFT pulled':>12} {'speedup':>8} {'plane':>6} {'outputs':>8}"
    )
    lines = [header, "-" * len(header)]
    for s in result.scenarios:
        speedup = "-" if s.speedup is None else f"{s.speedup:.1f}x"
        lines.append(
            f"{s.name:<8} {f'{s.tokens_from_peer}/{s.prompt_tokens} tok':>13} "
            f"{_size(s.bytes_from_peer):>10} {_rate(s.transfer_gbps):>11} "
            f"{_secs(s.ttft_local_s):>11} {_secs(s.ttft_pulled_s):>12} {speedup:>8} "
            f"{s.data_plane:>6} {'match' if s.outputs_match else 'DIFFER':>8}"
        )
    lines.append("")
    for s in result.scenarios:
        lines.extend(f"{s.name}: {problem}" for problem in s.problems)
    verdict = "ok" if result.ok else "FAILED"
    lines.append(
        f"kvpeer demo {verdict}: {len(result.scenarios)} scenarios over the OpenAI HTTP API "
        f"through kvpeer router in {result.seconds:.0f} s"
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
