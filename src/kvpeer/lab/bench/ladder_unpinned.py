"""``kvpeer bench ladder --unpinned``: whether the router, left to choose, declines a pull
from a busy producer whose blocks fell out of its held region.

The same two ``vllm serve`` engines as the ladder (kvpeer tier with the README's defaults:
held blocks a quarter of the CPU tier, pulling ahead) behind one ``kvpeer router`` in
shared mode with its default configuration (pinning allowed, for the references only).
Each round ``a`` computes two fresh prompts U and P, then :attr:`UnpinnedSpec.fillers`
more, so that U's and P's blocks leave ``a``'s held copy (LRU, a quarter of the tier)
while its CPU tier and the router's index still hold them. Then three arms, each sent
while another client's long prompt prefills on ``a`` (through the same router, so it
sees the load), in an order that turns every round:

- *unpinned*: U with no header: the router chooses the engine and whether to pull
  (:func:`classify`: ``pull`` (or ``explore``), ``declined`` (``b`` computes:
  ``compute: pull slower``), ``holder`` (``a`` serves from its own cache, behind its
  prefill), ``compute``);
- *pinned*: P on ``b`` pulled from ``a`` (``X-Kvpeer-Engine`` and ``X-Kvpeer-Source``):
  what the pull costs when taken;
- *computed*: a fresh prompt nobody holds on ``b``: what computing locally costs.

Per request: the router's plan and headers (engine, source, predicted TTFT, the
rejected pull's predicted TTFT), the client's TTFT, the source's held share as the
router's ``/metrics`` showed it just before the request
(``kvpeer_router_source_held_share``), and from the engines' traces how long ``a`` took
from a fetch for it to its first write (its serve window when not held). Ratios are
taken within a round and their median reported (rounds are the turns).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpeer.lab.bench.ladder import BUSY_START_S, engine_pair, fleet_logs, timeline

__all__ = ["ARMS", "Request", "UnpinnedSpec", "classify", "held_share", "order", "render", "run",
           "source_wait_ms", "summarize"]

Progress = Callable[[str], None]
ARMS = ("unpinned", "pinned", "computed")
RATIOS = ("unpinned/pinned", "unpinned/computed", "pinned/computed")
PRODUCER, CONSUMER = "a", "b"
DECISIONS = ("pull", "explore", "declined", "holder", "compute", "other")
_SHARE = re.compile(r'^kvpeer_router_source_held_share\{source="([^"]*)"\}\s+(\S+)$')


@dataclass(frozen=True)
class UnpinnedSpec:
    prompts: int = 5  # rounds
    prompt_tokens: int = 1536
    busy_tokens: int = 2000
    idle_s: float = 1.0
    #: fresh prompts ``a`` computes after U and P: a 1,536-token prompt is 36 MiB, the
    #: default held copy 192 MiB (a quarter of the bench's 768 MiB tier), so six push
    #: both out of it (LRU) and leave them in the tier
    fillers: int = 6
    held_bytes: int | None = None
    sync_pull_wait_s: float | None = None


@dataclass
class Request:
    """One measured request, as the client and the router's headers saw it."""

    round: int
    arm: str
    position: int  # 0-based place of the arm in its round
    ttft_s: float
    engine: str
    plan: str
    source: str | None
    predicted_ttft_s: float | None
    rejected_pull_ttft_s: float | None
    cached_tokens: int
    held_share: float | None  # the router's gauge for the producer, just before
    busy_overlapped: bool  # the producer's long prefill still ran at the answer
    request_id: str = ""
    source_wait_ms: float | None = None  # a: first fetch received -> first write
    decision: str = field(init=False)

    def __post_init__(self) -> None:
        self.decision = classify(self.engine, self.plan, self.source)


def classify(engine: str, plan: str, source: str | None) -> str:
    """What the router did with a prompt the busy producer holds: ``pull`` (the consumer
    pulls it), ``explore`` (the same, a pull predicted a little slower tried on purpose:
    the cost model's rule 6), ``declined`` (the consumer computes it, the pull judged
    slower), ``holder`` (the producer serves it from its own cache), ``compute`` (the
    consumer computes, no pull considered), ``other`` (a failure, or an engine not in
    the pair)."""
    from kvpeer.router.reasons import REASON_PULL_EXPLORE, REASON_PULL_SLOWER

    if engine == CONSUMER and source == PRODUCER:
        return "explore" if plan == REASON_PULL_EXPLORE else "pull"
    if engine == CONSUMER and source is None:
        return "declined" if plan == REASON_PULL_SLOWER else "compute"
    if engine == PRODUCER:
        return "holder"
    return "other"


def held_share(metrics_page: str, source: str) -> float | None:
    """``source``'s ``kvpeer_router_source_held_share`` on a router's ``/metrics``."""
    for line in metrics_page.splitlines():
        match = _SHARE.match(line.strip())
        if match is not None and match[1] == source:
            try:
                return float(match[2])
            except ValueError:
                return None
    return None


def source_wait_ms(events: Sequence[Mapping[str, Any]]) -> float | None:
    """From a request's timeline (:func:`kvpeer.lab.bench.ladder.timeline`): the
    producer's first ``fetch_received`` to its next ``transfer_started``; None if it
    never fetched (nothing pulled) or never wrote."""
    received = None
    for event in events:
        if event["engine"] != PRODUCER:
            continue
        if received is None and event["event"] == "fetch_received":
            received = float(event["ms"])
        elif received is not None and event["event"] == "transfer_started":
            return round(float(event["ms"]) - received, 1)
    return None


def order(round_index: int) -> tuple[str, ...]:
    """The arms of round ``round_index``, turned by one each round."""
    k = round_index % len(ARMS)
    return ARMS[k:] + ARMS[:k]


def _headers(arm: str) -> dict[str, str]:
    from kvpeer.router.app import PIN_HEADER
    from kvpeer.router.forward import SOURCE_HEADER

    if arm == "pinned":
        return {PIN_HEADER: CONSUMER, SOURCE_HEADER: PRODUCER}
    if arm == "computed":
        return {PIN_HEADER: CONSUMER}
    return {}


def _seconds(headers: Mapping[str, str], name: str) -> float | None:
    value = headers.get(name)
    return None if value is None else float(value)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return str(answer.read().decode())


def run(
    spec: UnpinnedSpec, model_dir: Path, progress: Progress, log_dir: Path | None = None
) -> dict[str, Any]:
    from kvpeer.lab.bench.ladder import _Background
    from kvpeer.lab.demo_run import MODEL_NAME, VOCAB, _pin, _wait_indexed, shared_pinned_config
    from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama
    from kvpeer.lab.engines.openai_client import OpenAIClient
    from kvpeer.lab.engines.serving import ServeFleet
    from kvpeer.router.background import BackgroundRouter

    model = ensure_llama(model_dir, SERVE_LLAMA_CONFIG)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-bench-ladder-unpinned-"))
    logs.mkdir(parents=True, exist_ok=True)
    # the ladder's pair: U and P stay in a's 768 MiB tier after the fillers
    engines = engine_pair(model, spec.held_bytes, spec.sync_pull_wait_s)
    rng = random.Random(20261207)

    def fresh(tokens: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(tokens)]

    requests: list[Request] = []
    load = {"start": os.getloadavg()[0], "end": 0.0}
    fleet = ServeFleet(logs, progress)
    ok = False
    try:
        progress("starting two vllm serve engines with the kvpeer tier (README defaults, shm)")
        fleet.start(list(engines))
        with contextlib.ExitStack() as stack:
            router = stack.enter_context(BackgroundRouter(shared_pinned_config(*engines)))
            client = OpenAIClient(router.url, MODEL_NAME)
            other = OpenAIClient(router.url, MODEL_NAME)
            stack.callback(client.close)
            stack.callback(other.close)
            progress("warm-up: a computes and b pulls once")
            warm = fresh(spec.prompt_tokens)
            client.complete(warm, 2, _pin(PRODUCER))
            _wait_indexed(router, PRODUCER, warm)
            client.complete(warm, 2, _pin(CONSUMER))
            for n in range(spec.prompts):
                prompts = {"unpinned": fresh(spec.prompt_tokens),
                           "pinned": fresh(spec.prompt_tokens),
                           "computed": fresh(spec.prompt_tokens)}  # fmt: skip
                for arm in ("unpinned", "pinned"):
                    client.complete(prompts[arm], 2, _pin(PRODUCER))
                for _ in range(spec.fillers):  # U and P leave a's held copy
                    client.complete(fresh(spec.prompt_tokens), 2, _pin(PRODUCER))
                _wait_indexed(router, PRODUCER, prompts["unpinned"])
                _wait_indexed(router, PRODUCER, prompts["pinned"])
                for position, arm in enumerate(order(n)):
                    time.sleep(spec.idle_s)
                    busy = _Background(other, fresh(spec.busy_tokens), _pin(PRODUCER))
                    time.sleep(BUSY_START_S)
                    share = held_share(_get(router.url + "/metrics"), PRODUCER)
                    got = client.complete(prompts[arm], 2, _headers(arm))
                    still = not busy.done.is_set()
                    busy.join()
                    h = got.headers
                    requests.append(Request(
                        round=n, arm=arm, position=position, ttft_s=got.ttft_s,
                        engine=h.get("x-kvpeer-engine", ""), plan=h.get("x-kvpeer-plan", ""),
                        source=h.get("x-kvpeer-source"),
                        predicted_ttft_s=_seconds(h, "x-kvpeer-predicted-ttft-seconds"),
                        rejected_pull_ttft_s=_seconds(h, "x-kvpeer-rejected-pull-ttft-seconds"),
                        cached_tokens=got.cached_tokens, held_share=share,
                        busy_overlapped=still, request_id=h.get("x-kvpeer-request-id", ""),
                    ))  # fmt: skip
                mine = requests[-len(ARMS):]
                progress(f"round {n + 1}/{spec.prompts}: " + ", ".join(
                    f"{r.arm} {r.ttft_s * 1000:.0f} ms ({r.decision})" for r in mine))  # fmt: skip
        load["end"] = os.getloadavg()[0]
        ok = True
    finally:
        fleet.close()
    paths = fleet_logs(logs)
    for request in requests:
        request.source_wait_ms = source_wait_ms(timeline(paths, request.request_id))
    if ok and log_dir is None:
        shutil.rmtree(logs, ignore_errors=True)
    return summarize(spec, requests, load)


def summarize(
    spec: UnpinnedSpec, requests: Sequence[Request], load: Mapping[str, float]
) -> dict[str, Any]:
    """Medians per arm, the median of per-round ratios, the unpinned arm's decisions."""
    by_round: dict[int, dict[str, Request]] = {}
    for request in requests:
        by_round.setdefault(request.round, {})[request.arm] = request
    ratios: dict[str, float | None] = {}
    per_round: dict[str, list[float]] = {}
    for name in RATIOS:
        top, bottom = name.split("/")
        values = [arms[top].ttft_s / arms[bottom].ttft_s for arms in by_round.values()
                  if top in arms and bottom in arms and arms[bottom].ttft_s > 0]  # fmt: skip
        per_round[name] = values
        ratios[name] = statistics.median(values) if values else None
    medians: dict[str, float | None] = {}
    decisions: dict[str, dict[str, int]] = {}
    for arm in ARMS:
        mine = [r for r in requests if r.arm == arm]
        medians[arm] = statistics.median(r.ttft_s for r in mine) if mine else None
        decisions[arm] = {d: sum(1 for r in mine if r.decision == d) for d in DECISIONS}
    return {
        "spec": asdict(spec),
        "load_average": dict(load),
        "medians": medians,
        "ratios": ratios,
        "per_round_ratios": per_round,
        "decisions": decisions,
        "requests": [asdict(r) for r in requests],
    }


def render(result: Mapping[str, Any]) -> str:
    spec = result["spec"]
    load = result["load_average"]
    lines = [
        f"kvpeer bench ladder --unpinned: {spec['prompts']} rounds; a busy with a "
        f"{spec['busy_tokens']}-token prefill, each prompt ({spec['prompt_tokens']} tokens) "
        f"out of a's held copy ({spec['fillers']} fillers); load average "
        f"{load['start']:.1f} -> {load['end']:.1f}",
        f"{'round':>5} {'arm':<9} {'decision':<9} {'engine':<6} {'plan':<21} {'src':<3} "
        f"{'TTFT ms':>8} {'pred ms':>8} {'rej ms':>8} {'share':>5} {'a wait':>7} {'busy':>4}",
    ]
    for r in result["requests"]:
        lines.append(
            f"{r['round'] + 1:>5} {r['arm']:<9} {r['decision']:<9} {r['engine']:<6} "
            f"{r['plan'][:21]:<21} {r['source'] or '-':<3} {r['ttft_s'] * 1000:>8.0f} "
            f"{_ms(r['predicted_ttft_s']):>8} {_ms(r['rejected_pull_ttft_s']):>8} "
            f"{_share(r['held_share']):>5} {_plain_ms(r['source_wait_ms']):>7} "
            f"{'yes' if r['busy_overlapped'] else 'no':>4}"
        )
    lines.append("TTFT medians: " + ", ".join(
        f"{arm} {_ms(result['medians'][arm])} ms" for arm in ARMS))  # fmt: skip
    for name in RATIOS:
        values = ", ".join(f"{v:.2f}" for v in result["per_round_ratios"][name])
        lines.append(f"{name:<18} {_x(result['ratios'][name]):>7}  median of rounds: {values}")
    for arm in ARMS:
        counts = result["decisions"][arm]
        lines.append(f"{arm} decisions: " + ", ".join(
            f"{d} {counts[d]}" for d in DECISIONS if counts[d]))  # fmt: skip
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _plain_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
