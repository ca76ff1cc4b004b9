"""``kvpeer bench ladder``: what one fresh prompt costs, computed, local, pulled idle, pulled busy.

Two ``vllm serve`` engines with the kvpeer tier as a user runs them (``shm`` plane,
held blocks, kvpeer's connector and manager) behind ``kvpeer router`` in shared mode
with pinning. Each round takes two fresh prompts, P and Q, and measures the time to
first token at the client (streamed) of:

(a) *computed*: ``a`` computes P (Q is computed too, unmeasured);
(b) *local*: after ``idle_s``, ``a`` serves P again from its own prefix cache;
(c) *pulled, idle producer*: after ``idle_s``, ``b`` serves P; the router names ``a``
    as the source and ``b`` pulls P's blocks;
(d) *pulled, busy producer*: another client sends ``a`` a fresh long prompt, and
    while ``a`` is in the middle of that prefill, ``b`` serves Q, pulled from ``a``.
    Whether the long prefill was still running when Q's first token came is counted.
(e) *local, busy neighbour*: the same again, but ``b`` serves P, which it already
    holds (it pulled P in (c)): a local hit on ``b`` while ``a`` prefills. Engines that
    share a machine's cores slow each other down with or without kvpeer; (d) / (e) is
    the part of (d) that is the pull's.
(f) *pulled, queued*: another client sends ``b`` itself a fresh long prompt, and while
    ``b`` prefills it, ``b`` is sent a third fresh prompt R, pulled from ``a``: the
    request waits in ``b``'s queue before its lookup. Its reference is (g) *local,
    queued*: ``b`` serves P (a local hit) behind such a prefill.

With ``ahead`` (the default) both tiers obey prefetches (by default, from loopback) and a second
router, which knows ``b`` pulls ahead, sends (c), (d) and (f) again for three more fresh
prompts of the round: *ahead idle*, *ahead busy* and *ahead queued*, the pull started by
the router's prefetch (kvpeer.node.ahead) rather than by ``b``'s lookup; queued, the pull
can hide behind the wait. The first router never prefetches,
so both ways are measured on the same engines in the same run.

The ratios are the issue's goals: (c) <= 1.5x (b), (d) <= 2x (b), (c) <= 0.1x (a). The
step timeline of the slowest pulled request (and of the slowest started ahead, with the
prefetch's own fetch) is read from both engines' traces
(``KVPEER_TRACE=1``, kvpeer.node.trace), the router's trace of it, and the client's own
times (sent, first token), so it spans the whole request.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import re
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpeer.node.trace import TRACE_LOGGER

__all__ = ["LadderSpec", "engine_pair", "render", "run", "timeline"]

Progress = Callable[[str], None]
RUNGS = ("computed", "local", "pulled_idle", "pulled_busy", "local_busy", "ahead_idle",
         "ahead_busy", "pulled_queued", "ahead_queued", "local_queued")  # fmt: skip
GOALS = {"pulled_idle/local": 1.5, "pulled_busy/local": 2.0, "pulled_idle/computed": 0.1,
         "ahead_idle/local": 1.5, "ahead_busy/local": 2.0, "ahead_idle/computed": 0.1}
#: not goals: what the busy producer's CPU costs the consumer on this machine by itself,
#: and what pulling ahead saves over a pull started by the lookup
CONTEXT = ("pulled_busy/local_busy", "ahead_idle/pulled_idle", "ahead_busy/pulled_busy",
           "pulled_queued/local_queued", "ahead_queued/local_queued",
           "ahead_queued/pulled_queued")  # fmt: skip
BUSY_START_S = 0.25  # after sending the long prompt: its prefill has started


@dataclass(frozen=True)
class LadderSpec:
    prompts: int = 5
    prompt_tokens: int = 1536
    busy_tokens: int = 2000  # the other client's long prompt (the model has 2,048 positions)
    idle_s: float = 1.0
    #: each tier's ``held_bytes`` (None: the product's default, a quarter of the CPU tier)
    held_bytes: int | None = None
    #: the tiers' ``sync_pull_wait_s`` (None: the product's default)
    sync_pull_wait_s: float | None = None
    #: also measure pulls the router starts ahead (a second router; kvpeer.node.ahead)
    ahead: bool = True


@dataclass
class _Pull:
    rung: str
    ttft_s: float
    request_id: str
    source: str | None
    same: bool


class _ClientLog:
    """The client's side of each pull, as trace lines: when it was sent, when its first
    token came (the timeline then spans client, router and both engines)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("w", encoding="utf-8")

    def complete(self, client: Any, prompt: list[int], headers: dict[str, str]) -> Any:
        sent = time.time()
        got = client.complete(prompt, 2, headers)
        request = got.headers.get("x-kvpeer-request-id", "")
        for t, event in ((sent, "sent"), (sent + got.ttft_s, "first_token")):
            self._file.write(f"kvpeer.trace t={t:.6f} node=client id={request} event={event}\n")
        self._file.flush()
        return got

    def close(self) -> None:
        self._file.close()


def _router_trace(path: Path) -> logging.Handler:
    """The in-process router's trace lines (``kvpeer.trace``, event ``sent``) to ``path``."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(TRACE_LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


class _Background:
    """Another client's completion, sent from a thread of its own."""

    def __init__(self, client: Any, prompt: list[int], headers: dict[str, str]) -> None:
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._send, args=(client, prompt, headers),
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _send(self, client: Any, prompt: list[int], headers: dict[str, str]) -> None:
        try:
            client.complete(prompt, 1, headers)
        finally:
            self.done.set()

    def join(self) -> None:
        self._thread.join(timeout=300)


def run(
    spec: LadderSpec, model_dir: Path, progress: Progress, log_dir: Path | None = None
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
    from kvpeer.lab.engines.serving import ServeFleet
    from kvpeer.router.background import BackgroundRouter

    model = ensure_llama(model_dir, SERVE_LLAMA_CONFIG)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-bench-ladder-"))
    logs.mkdir(parents=True, exist_ok=True)
    a, b = engine_pair(model, spec.held_bytes, spec.sync_pull_wait_s)
    rng = random.Random(20261203)

    def fresh(tokens: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(tokens)]

    samples: dict[str, list[float]] = {rung: [] for rung in RUNGS}
    pulls: list[_Pull] = []
    busy_overlapped = 0
    staged: dict[str, float] = {}  # b's pulling-ahead counters at the end
    fleet = ServeFleet(logs, progress)
    client_log = _ClientLog(logs / "client.log")
    router_log = _router_trace(logs / "router.log")
    ok = False
    try:
        progress("starting two vllm serve engines with the kvpeer tier (held blocks, shm)")
        fleet.start([a, b])
        plain_config = shared_pinned_config(a, b)
        plain_config = replace(plain_config, engines=tuple(
            replace(e, spec=replace(e.spec, pulls_ahead=False)) for e in plain_config.engines
        ))  # fmt: skip
        routers = [plain_config, shared_pinned_config(a, b)] if spec.ahead else [plain_config]
        with contextlib.ExitStack() as stack:
            started = [stack.enter_context(BackgroundRouter(config)) for config in routers]
            router = started[0]
            ahead = started[-1] if spec.ahead else None
            client = OpenAIClient(router.url, MODEL_NAME)
            other = OpenAIClient(router.url, MODEL_NAME)
            ahead_client = OpenAIClient(ahead.url, MODEL_NAME) if ahead is not None else None
            # the other client's long prompts go through the router of the pull they
            # delay: each router then sees the load it is up against, as in production
            ahead_other = OpenAIClient(ahead.url, MODEL_NAME) if ahead is not None else None
            stack.callback(client.close)
            stack.callback(other.close)
            for extra_client in (ahead_client, ahead_other):
                if extra_client is not None:
                    stack.callback(extra_client.close)
            beside = {id(client): other, id(ahead_client): ahead_other}

            def indexed(*prompts: list[int]) -> None:
                for each in started:
                    for prompt in prompts:
                        _wait_indexed(each, "a", prompt)

            def behind(busy: str, via: Any, send: Callable[[], Any]) -> tuple[Any, bool]:
                """``send()`` while another client's long prefill, sent through ``via``'s
                router, runs on engine ``busy``; its answer, and whether that prefill still
                ran when the answer came."""
                long_prefill = _Background(beside[id(via)], fresh(spec.busy_tokens), _pin(busy))
                time.sleep(BUSY_START_S)
                got = send()
                still = not long_prefill.done.is_set()
                long_prefill.join()
                return got, still

            def pull_behind(via: Any, prompt: list[int], busy: str) -> Any:
                """``b`` serves ``prompt`` (pulled from ``a``) while ``a`` (a busy producer,
                counted in ``busy_overlapped``) or ``b`` itself (the request waits in its
                queue) prefills another client's long prompt."""
                nonlocal busy_overlapped
                got, still = behind(busy, via, lambda: client_log.complete(via, prompt, _pin("b")))
                if busy == "a":
                    busy_overlapped += still
                return got

            progress("warm-up: a computes and b pulls once")
            warm = fresh(spec.prompt_tokens)
            client.complete(warm, 2, _pin("a"))
            indexed(warm)
            client.complete(warm, 2, _pin("b"))
            for n in range(spec.prompts):
                p, q, r = (fresh(spec.prompt_tokens) for _ in range(3))
                samples["computed"].append(client.complete(p, 2, _pin("a")).ttft_s)
                extra = [fresh(spec.prompt_tokens) for _ in range(3 if ahead_client else 0)]
                for prompt in (q, r, *extra):
                    client.complete(prompt, 2, _pin("a"))
                indexed(p, q, r, *extra)
                # (b) and (c) each start from the same idle fleet: an engine's first
                # step after an idle second costs more than one right after another
                time.sleep(spec.idle_s)
                local = client.complete(p, 2, _pin("a"))
                samples["local"].append(local.ttft_s)
                time.sleep(spec.idle_s)
                measured = [("pulled_idle", client_log.complete(client, p, _pin("b")), local)]
                reference_q = client.complete(q, 2, _pin("a"))  # a local hit: the reference
                time.sleep(spec.idle_s)
                measured.append(("pulled_busy", pull_behind(client, q, "a"), reference_q))
                time.sleep(spec.idle_s)
                on_b = functools.partial(client.complete, p, 2, _pin("b"))  # b holds p
                samples["local_busy"].append(behind("a", client, on_b)[0].ttft_s)
                reference_r = client.complete(r, 2, _pin("a"))
                time.sleep(spec.idle_s)
                measured.append(("pulled_queued", pull_behind(client, r, "b"), reference_r))
                time.sleep(spec.idle_s)
                samples["local_queued"].append(behind("b", client, on_b)[0].ttft_s)
                if ahead_client is not None:
                    p2, q2, r2 = extra
                    references = [client.complete(x, 2, _pin("a")) for x in extra]
                    time.sleep(spec.idle_s)
                    got = client_log.complete(ahead_client, p2, _pin("b"))
                    measured.append(("ahead_idle", got, references[0]))
                    time.sleep(spec.idle_s)
                    got = pull_behind(ahead_client, q2, "a")
                    measured.append(("ahead_busy", got, references[1]))
                    time.sleep(spec.idle_s)
                    got = pull_behind(ahead_client, r2, "b")
                    measured.append(("ahead_queued", got, references[2]))
                for rung, got, reference in measured:
                    samples[rung].append(got.ttft_s)
                    pulls.append(_Pull(
                        rung, got.ttft_s, got.headers.get("x-kvpeer-request-id", ""),
                        got.headers.get("x-kvpeer-source"),
                        got.tokens == reference.tokens
                        and got.max_logprob_delta(reference) <= LOGPROB_TOLERANCE,
                    ))  # fmt: skip
                progress(f"round {n + 1}/{spec.prompts}: local {local.ttft_s * 1000:.0f} ms, "
                         + ", ".join(f"{rung.replace('_', ' ')} {got.ttft_s * 1000:.0f} ms"
                                     for rung, got, _ in measured))  # fmt: skip
            staged = _ahead_counts(b.url) if spec.ahead else {}
        ok = True
    finally:
        fleet.close()
        logging.getLogger(TRACE_LOGGER).removeHandler(router_log)
        router_log.close()
        client_log.close()
    plain = [pull for pull in pulls if not pull.rung.startswith("ahead")]
    slowest = max(plain, key=lambda pull: pull.ttft_s, default=None)
    steps = timeline(fleet_logs(logs), slowest.request_id) if slowest is not None else []
    ahead_pulls = [pull for pull in pulls if pull.rung.startswith("ahead")]
    slowest_ahead = max(ahead_pulls, key=lambda pull: pull.ttft_s, default=None)
    ahead_steps = (
        timeline(fleet_logs(logs), slowest_ahead.request_id) if slowest_ahead is not None else []
    )
    if ok and log_dir is None:
        shutil.rmtree(logs, ignore_errors=True)
    result = summarize(spec, samples, pulls, busy_overlapped, slowest, steps)
    result["ahead_counts"] = staged
    result["slowest_ahead"] = None if slowest_ahead is None else vars(slowest_ahead)
    result["ahead_timeline"] = ahead_steps
    return result


def engine_pair(model: Path, held_bytes: int | None, sync_pull_wait_s: float | None) -> Any:
    """``a`` and ``b`` (``ServeSpec``): the tiers as the README starts them (held blocks and
    pulling ahead are defaults; the routers of this process are obeyed from loopback),
    on ``shm``, traced, each with a 768 MiB CPU tier (a round stores up to seven prompts
    on ``a``: room for all, so none is evicted before ``b`` pulls it)."""
    from kvpeer.lab.engines.serving import ServeSpec
    from kvpeer.node.trace import TRACE_ENV

    options: dict[str, Any] = {}
    if held_bytes is not None:
        options["held_bytes"] = held_bytes
    if sync_pull_wait_s is not None:
        options["sync_pull_wait_s"] = sync_pull_wait_s
    return tuple(ServeSpec(name, model, data_plane="shm", tier_options=options,
                           env={TRACE_ENV: "1"}, cpu_bytes=768 << 20)
                 for name in ("a", "b"))  # fmt: skip


_AHEAD_LINE = re.compile(r'^vllm:kvpeer_(pull_ahead_total|staged_blocks)\{([^}]*)\} ([0-9.e+-]+)$')


def _ahead_counts(url: str) -> dict[str, float]:
    """Engine ``url``'s pulling-ahead counters and staged blocks, from its /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        match = _AHEAD_LINE.match(line)
        if match is None:
            continue
        event = re.search(r'event="([a-z_]+)"', match[2])
        name = event[1] if event else match[1]
        counts[name] = counts.get(name, 0.0) + float(match[3])
    return counts


def fleet_logs(logs: Path) -> list[Path]:
    return sorted(logs.glob("*.log"))


_TRACE = re.compile(r"kvpeer\.trace t=(?P<t>[0-9.]+) node=(?P<node>\S+) id=(?P<id>\S+) "
                    r"event=(?P<event>\S+) ?(?P<rest>.*)$")  # fmt: skip


def timeline(paths: list[Path], request_id: str) -> list[dict[str, Any]]:
    """The trace lines of ``request_id`` in the engines' logs, in time order, with ms
    since the first; with those of the fetch a prefetch for it started (a ``prefetch``
    line naming ``request=<request_id>`` gives that fetch's own id)."""
    if not request_id:
        return []
    matched = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            match = _TRACE.search(line)
            if match is not None:
                matched.append((path.stem, match))
    ids = {request_id}
    ids.update(m["id"] for _, m in matched
               if m["event"] == "prefetch" and f"request={request_id}" in m["rest"])  # fmt: skip
    events: list[dict[str, Any]] = []
    for engine, match in matched:
        if match["id"] in ids:
            events.append({"t": float(match["t"]), "engine": engine, "event": match["event"],
                           "detail": match["rest"].strip()})  # fmt: skip
    events.sort(key=lambda event: event["t"])
    start = events[0]["t"] if events else 0.0
    for event in events:
        event["ms"] = round((event.pop("t") - start) * 1000, 1)
    return events


def summarize(
    spec: LadderSpec,
    samples: dict[str, list[float]],
    pulls: list[_Pull],
    busy_overlapped: int,
    slowest: _Pull | None,
    steps: list[dict[str, Any]],
) -> dict[str, Any]:
    medians = {rung: statistics.median(v) if v else None
               for rung, v in {r: samples.get(r, []) for r in RUNGS}.items()}  # fmt: skip
    ratios: dict[str, float | None] = {}
    for name in (*GOALS, *CONTEXT):
        top, bottom = name.split("/")
        ratios[name] = (
            medians[top] / medians[bottom] if medians[top] and medians[bottom] else None  # type: ignore[operator]
        )
    return {
        "spec": vars(spec),
        "medians": medians,
        "ratios": ratios,
        "goals": GOALS,
        "met": {name: _within(ratios[name], goal) for name, goal in GOALS.items()},
        "pulled_from_producer": sum(1 for pull in pulls if pull.source == "a"),
        "pulls": len(pulls),
        "same_output": sum(1 for pull in pulls if pull.same),
        "busy_overlapped": busy_overlapped,
        "slowest": None if slowest is None else vars(slowest),
        "timeline": steps,
        "samples": samples,
    }


def _within(ratio: float | None, goal: float) -> bool:
    return ratio is not None and ratio <= goal


def render(result: dict[str, Any]) -> str:
    spec, medians = result["spec"], result["medians"]
    lines = [
        f"kvpeer bench ladder: {spec['prompts']} rounds of fresh {spec['prompt_tokens']}-token "
        f"prompts; TTFT medians (ms)",
        f"{'computed':>9} {'local hit':>10} {'pulled idle':>12} {'pulled busy':>12} "
        f"{'local busy':>11} {'ahead idle':>11} {'ahead busy':>11} {'pulled queued':>14} "
        f"{'ahead queued':>13} {'local queued':>13}",
        " ".join(
            f"{_ms(medians[rung]):>{width}}"
            for rung, width in zip(RUNGS, (9, 10, 12, 12, 11, 11, 11, 14, 13, 13), strict=True)
        ),
    ]
    for name, ratio in result["ratios"].items():
        if ratio is None and name.startswith("ahead"):
            continue  # --no-ahead
        if name.startswith("ahead") and name.split("/")[1].startswith("pulled"):
            note = "what pulling ahead saves over a pull the lookup starts"
        elif name.endswith("/local_queued"):
            note = "a pull into a busy consumer over its local hit (both queued)"
        elif name in result["goals"]:
            verdict = "met" if result["met"][name] else "missed"
            note = f"goal <= {result['goals'][name]:g}x: {verdict}"
        else:
            note = "the pull's part of a busy pull (local busy: b's local hit while a prefills)"
        lines.append(f"{name:<22} {_x(ratio):>8}  {note}")
    lines.append(
        f"pulls from the producer: {result['pulled_from_producer']}/{result['pulls']}; same output "
        f"as the local hit: {result['same_output']}/{result['pulls']}; busy pulls that finished "
        f"while the producer's long prefill ran: {result['busy_overlapped']}/"
        f"{len(result['samples']['pulled_busy']) + len(result['samples'].get('ahead_busy', []))}"
    )
    counts = result.get("ahead_counts") or {}
    if counts:
        lines.append(
            "pulled ahead into b (its /metrics at the end, a few seconds behind): " + ", ".join(
                f"{name} {int(counts.get(name, 0))}"
                for name in ("prefetches", "refused", "blocks_staged", "jobs_adopted",
                             "jobs_served", "blocks_expired", "staged_blocks")
            ) + " (jobs_adopted: taken into the cache with no copy; staged_blocks: left now)"
        )  # fmt: skip
    slowest = result["slowest"]
    if slowest is not None:
        lines.append(
            f"slowest pull: {slowest['rung']} {slowest['ttft_s'] * 1000:.0f} ms "
            f"(request {slowest['request_id'] or '?'}); its trace:"
        )
        lines.extend(
            f"  {event['ms']:>8.1f} ms  {event['engine']:<7} {event['event']:<24} {event['detail']}"
            for event in result["timeline"]
        )
    ahead = result.get("slowest_ahead")
    if ahead is not None:
        lines.append(
            f"slowest pull started ahead: {ahead['rung']} {ahead['ttft_s'] * 1000:.0f} ms "
            f"(request {ahead['request_id'] or '?'}); its trace, with its prefetch's fetch:"
        )
        lines.extend(
            f"  {event['ms']:>8.1f} ms  {event['engine']:<7} {event['event']:<24} {event['detail']}"
            for event in result["ahead_timeline"]
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
