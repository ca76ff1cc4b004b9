"""The serving path for real: two ``vllm serve`` engines with the kvpeer tier behind
``kvpeer router``, over HTTP, with vLLM's KV events feeding the router's index.

One pair of engines serves the whole module (starting one takes about a minute here);
tests use fresh prompts, so what one test leaves cached does not help another. Every
output is compared with the same request computed by an engine that did not pull.
"""

from __future__ import annotations

import json
import random
import signal
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client.parser import text_string_to_metric_families

from kvpeer.lab.engines.launcher import shm_files
from kvpeer.lab.engines.model import token_text
from kvpeer.lab.engines.openai_client import OpenAIClient
from kvpeer.lab.engines.serving import ServeFleet, ServeSpec
from kvpeer.router.background import BackgroundRouter
from kvpeer.router.config import EngineEntry, RouterConfig
from kvpeer.router.index import MEDIUM_CPU
from kvpeer.router.policy import Mode, Role

pytestmark = pytest.mark.slow  # real vllm serve engines

MODEL = "kvpeer-demo"
BLOCK = 32
PROMPT = 512  # about 0.3 s to compute here, a few ms to pull
OUT = 6
PIN = "X-Kvpeer-Engine"
SOURCE = "X-Kvpeer-Source"  # pins the source: the pull, not the router's choice
_rng = random.Random(7)


def fresh(n: int = PROMPT) -> list[int]:
    return [_rng.randrange(3, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def fleet(serve_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeFleet]:
    specs = [ServeSpec(name, serve_llama) for name in "ab"]
    engines = ServeFleet(tmp_path_factory.mktemp("serve-logs"))
    try:
        engines.start(specs)
        yield engines
    finally:
        engines.close()
        for spec in specs:
            assert shm_files(spec.engine_id) == [], "named region files left behind"


def entries(fleet: ServeFleet, roles: tuple[Role, Role]) -> tuple[EngineEntry, ...]:
    a, b = (fleet.engines[name].spec for name in "ab")
    return (EngineEntry(a.router_engine(roles[0])), EngineEntry(b.router_engine(roles[1])))


@pytest.fixture(scope="module")
def shared(fleet: ServeFleet) -> Iterator[BackgroundRouter]:
    config = RouterConfig(
        Mode.SHARED, entries(fleet, (Role.BOTH, Role.BOTH)), listen_port=0,
        allow_pinning=True, health_interval_s=0.5,
    )
    with BackgroundRouter(config) as router:
        yield router


@pytest.fixture(scope="module")
def pd(fleet: ServeFleet) -> Iterator[BackgroundRouter]:
    config = RouterConfig(
        Mode.PD, entries(fleet, (Role.PREFILL, Role.DECODE)), listen_port=0,
        health_interval_s=0.5,
    )
    with BackgroundRouter(config) as router:
        yield router


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> tuple[dict[str, Any], dict[str, str]]:
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read()), {k.lower(): v for k, v in reply.headers.items()}


def greedy(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": OUT, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def kvpeer_metrics(url: str) -> dict[str, float]:
    """``vllm:kvpeer_*`` samples of an engine's /metrics: ``name`` or ``name[label]``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvpeer_"):
                ours = [v for k, v in sample.labels.items() if k not in ("engine", "model_name")]
                key = sample.name + (f"[{','.join(ours)}]" if ours else "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def wait_indexed(router: BackgroundRouter, engine: str, prompt: list[int]) -> None:
    index = router.router.index
    assert index is not None

    def held() -> int:
        # Built on every poll: a new router's index learns the block size from its first
        # event, and keys built before that match nothing, ever (this made the late
        # router's replay test time out whenever the replay came after the first poll).
        return index.longest_prefix(engine, index.keys(prompt), MEDIUM_CPU, time.monotonic())

    feed = router.router.subscribers[engine]
    deadline = time.monotonic() + 30
    while router.call(held) < len(prompt) // BLOCK * BLOCK - BLOCK:
        assert time.monotonic() < deadline, (
            f"timed out waiting for {engine}'s KV events for the prompt: "
            f"{router.call(feed.statistics)}")
        time.sleep(0.1)


def test_pd_through_the_router_equals_a_local_run_and_pulls_every_block(
    fleet: ServeFleet, pd: BackgroundRouter
) -> None:
    prompt = fresh()
    answer, headers = post(pd.url, greedy(prompt))
    reference, _ = post(fleet.engines["a"].spec.url, greedy(prompt))

    assert answer["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= PROMPT - BLOCK
    assert headers["x-kvpeer-engine"] == "b"
    assert headers["x-kvpeer-source"] == "a"
    assert float(headers["x-kvpeer-prefill-seconds"]) > 0
    assert "kv_transfer_params" not in answer


def test_shared_streamed_pull_is_the_routers_choice_and_the_counters_add_up(
    fleet: ServeFleet, shared: BackgroundRouter
) -> None:
    a, b = (fleet.engines[name].spec.url for name in "ab")
    client = OpenAIClient(shared.url, MODEL)
    prompt = fresh()
    computed = client.complete(prompt, OUT, {PIN: "a"})
    wait_indexed(shared, "a", prompt)
    # A series an engine has not counted yet is absent from its /metrics: zero.
    served_before = defaultdict(float, kvpeer_metrics(a))
    pulled_before = defaultdict(float, kvpeer_metrics(b))

    pulled = client.complete(token_text(prompt), OUT, {PIN: "b"})  # text: router tokenizes

    assert pulled.headers["x-kvpeer-source"] == "a"
    assert pulled.tokens == computed.tokens
    assert pulled.max_logprob_delta(computed) <= 1e-4
    assert pulled.cached_tokens >= PROMPT - BLOCK
    # The producer was idle: its counters reach vLLM's /metrics with its next step.
    client.complete(fresh(40), 1, {PIN: "a"})

    def moved() -> bool:
        served = kvpeer_metrics(a)["vllm:kvpeer_served_bytes_total"]
        got = kvpeer_metrics(b)["vllm:kvpeer_pulled_bytes_total"]
        return served > served_before["vllm:kvpeer_served_bytes_total"] and (
            got > pulled_before["vllm:kvpeer_pulled_bytes_total"])

    wait_for(moved, 10, "kvpeer's counters on both engines' /metrics")
    after_a, after_b = kvpeer_metrics(a), kvpeer_metrics(b)
    served = after_a["vllm:kvpeer_served_bytes_total"] - served_before[
        "vllm:kvpeer_served_bytes_total"]
    got = after_b["vllm:kvpeer_pulled_bytes_total"] - pulled_before[
        "vllm:kvpeer_pulled_bytes_total"]
    blocks = after_b["vllm:kvpeer_pulled_blocks_total"] - pulled_before[
        "vllm:kvpeer_pulled_blocks_total"]
    fetches = after_b["vllm:kvpeer_fetches_total[ok]"] - pulled_before[
        "vllm:kvpeer_fetches_total[ok]"]
    observed = after_b["vllm:kvpeer_fetch_duration_seconds_count"] - pulled_before[
        "vllm:kvpeer_fetch_duration_seconds_count"]
    assert got == served > 0
    assert blocks * BLOCK >= PROMPT - BLOCK
    assert got % blocks == 0
    assert fetches == observed >= 1
    client.close()


def test_chat_turn_two_on_the_other_engine_pulls_turn_one(
    fleet: ServeFleet, shared: BackgroundRouter
) -> None:
    client = OpenAIClient(shared.url, MODEL)
    direct = OpenAIClient(fleet.engines["a"].spec.url, MODEL)
    first = [{"role": "user", "content": token_text(fresh(448))}]
    answer = client.chat(first, OUT, {PIN: "a"})
    second = [*first, {"role": "assistant", "content": token_text(answer.tokens)},
              {"role": "user", "content": token_text(fresh(40))}]
    wait_indexed(shared, "a", [int(w[1:]) for w in first[0]["content"].split()])

    # The source is pinned: whether to pull is the router's choice, tested above; on a
    # loaded machine it may predict computing faster (a CI run did), which is not
    # what this test is about.
    pulled = client.chat(second, OUT, {PIN: "b", SOURCE: "a"})
    reference = direct.chat(second, OUT)

    assert pulled.headers["x-kvpeer-source"] == "a"
    assert pulled.tokens == reference.tokens
    assert pulled.cached_tokens >= 448 - BLOCK
    client.close()
    direct.close()


def test_a_router_started_later_relearns_what_the_engines_hold(
    fleet: ServeFleet, shared: BackgroundRouter
) -> None:
    """A router restart loses the index. The new one asks every engine's replay buffer
    for what it missed and follows the live events; what it has not learned it routes
    by load, never by stale affinity. Once the engine's events tell it, it pulls."""
    config = RouterConfig(Mode.SHARED, entries(fleet, (Role.BOTH, Role.BOTH)), listen_port=0,
                          allow_pinning=True)
    with BackgroundRouter(config) as restarted:
        client = OpenAIClient(restarted.url, MODEL)
        prompt = fresh(1024)
        client.complete(prompt, OUT, {PIN: "a"})
        wait_indexed(restarted, "a", prompt)  # learned from the engine's own events
        pulled = client.complete(prompt, OUT, {PIN: "b"})
        client.close()
    assert pulled.headers.get("x-kvpeer-source") == "a"
    assert pulled.cached_tokens >= 1024 - BLOCK


def test_a_router_started_after_the_engines_learns_what_they_stored_from_their_replay(
    fleet: ServeFleet,
) -> None:
    """Issue 30, item 2: the engines compute prompts first, with no router of this test
    running; then a router starts. Nothing new happens on the engines, so no live event
    can teach it: what its index knows it learned from each engine's replay endpoint
    (each feed asks for every batch from 0 once its subscription is connected). It routes
    by that at once: a request pinned to ``b`` pulls the prefix ``a`` computed before the
    router existed."""
    stored = {"a": fresh(1024), "b": fresh(512)}
    for name, prompt in stored.items():
        direct = OpenAIClient(fleet.engines[name].spec.url, MODEL)
        direct.complete(prompt, OUT)
        direct.close()
    config = RouterConfig(Mode.SHARED, entries(fleet, (Role.BOTH, Role.BOTH)), listen_port=0,
                          allow_pinning=True)
    with BackgroundRouter(config) as late:
        for name, prompt in stored.items():
            wait_indexed(late, name, prompt)
            feed = late.call(late.router.subscribers[name].statistics)
            assert feed.replays_completed >= 1, feed
            assert feed.batches_applied >= 1, feed
        client = OpenAIClient(late.url, MODEL)
        pulled = client.complete(stored["a"], OUT, {PIN: "b"})
        client.close()
    assert pulled.headers.get("x-kvpeer-source") == "a"
    assert pulled.cached_tokens >= 1024 - BLOCK


def test_a_client_cannot_make_an_engine_dial_a_host_of_its_choosing(
    fleet: ServeFleet, shared: BackgroundRouter
) -> None:
    """The attacker names a host in kv_transfer_params: no engine ever dials it (a dial
    would show up as a session or a failed fetch on the engine's kvpeer counters)."""
    urls = [fleet.engines[name].spec.url for name in "ab"]
    before = [kvpeer_metrics(url) for url in urls]
    hostile = {"remote_kv_source": {"kv_request_id": "x", "remote_host": "10.0.0.1",
                                    "remote_port": 1}}
    started = time.monotonic()
    answer, _ = post(shared.url, greedy(fresh(), kv_transfer_params=hostile))
    assert time.monotonic() - started < 30
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for url, old in zip(urls, before, strict=True):
        new = kvpeer_metrics(url)
        for key in ("vllm:kvpeer_fetches_total[failed]", "vllm:kvpeer_lookups_total[retry]",
                    "vllm:kvpeer_session_events_total[opened]"):
            assert new[key] == old[key], key


def test_a_second_router_sees_the_load_the_first_put_on_an_engine(
    fleet: ServeFleet, shared: BackgroundRouter
) -> None:
    """Router replicas: the shared router keeps three long generations running on ``a``;
    a second router, which sent none of them, reads them from ``a``'s own /metrics
    (vllm:num_requests_running) and places its requests on ``b``."""
    from concurrent.futures import ThreadPoolExecutor

    config = RouterConfig(
        Mode.SHARED, entries(fleet, (Role.BOTH, Role.BOTH)), listen_port=0,
        health_interval_s=0.5, load_scrape_interval_s=0.25,
    )
    # Long enough to outlast the wait for a's /metrics and the two requests on a loaded
    # machine (400 tokens did not, once in CI); within max_model_len (2,048) with the prompt.
    long_body = {**greedy(fresh(64)), "max_tokens": 1600}
    with BackgroundRouter(config) as second, ThreadPoolExecutor(3) as pool:
        feed = second.router.engine_load
        assert feed is not None
        held = [pool.submit(post, shared.url, {**long_body, "prompt": fresh(64)},
                            {PIN: "a"}) for _ in range(3)]  # fmt: skip

        def reported_on_a() -> float:
            report = second.call(lambda: feed.report("a"))
            return 0.0 if report is None else report.running + report.waiting

        wait_for(lambda: reported_on_a() >= 3, 60, "a's /metrics to report 3 requests")
        in_flight, _ = second.call(lambda: feed.combine("a", 0, 0, 64.0))
        assert in_flight >= 3  # the second router's view of a: the first one's requests
        served = [post(second.url, greedy(fresh(64)))[1]["x-kvpeer-engine"] for _ in range(2)]
        assert all(not done.done() for done in held), "the long generations ended too soon"
        assert served == ["b", "b"]
        for done in held:
            assert done.result()[1]["x-kvpeer-engine"] == "a"


def process_start(pid: int) -> float:
    """When ``pid`` started (seconds since the epoch), from /proc."""
    import os

    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def test_an_engines_metrics_tell_its_api_servers_start_time(fleet: ServeFleet) -> None:
    """What the router's start-time witness reads (health rule 3) is the API server's."""
    import asyncio

    import aiohttp

    from kvpeer.router.witness import start_time

    async def read(url: str) -> float | None:
        async with aiohttp.ClientSession() as session:
            return await start_time(session, url)

    for engine in fleet.engines.values():
        reading = asyncio.run(read(engine.spec.url))
        assert reading is not None
        # Both are the kernel's boot time plus the process's start ticks; the boot time
        # is whole seconds and may step by one between the API server's read and ours
        # (a VM's clock: CI saw exactly 1.00 s), so the ticks must agree and the boot
        # times be at most a step apart.
        apart = reading - process_start(engine.process.pid)
        assert abs(apart) <= 1.02
        assert abs(apart - round(apart)) < 0.02


def test_a_killed_engine_is_routed_around_and_relearned_after_its_restart(
    fleet: ServeFleet, shared: BackgroundRouter, pd: BackgroundRouter
) -> None:
    """Last in the module: it kills and restarts engine a."""
    b = fleet.engines["b"].spec.url
    fleet.engines["a"].signal(signal.SIGKILL)
    fleet.engines["a"].process.wait(timeout=30)

    for _ in range(3):  # shared: served by b, retried before the first byte if need be
        prompt = fresh()
        answer, headers = post(shared.url, greedy(prompt))
        reference, _ = post(b, greedy(prompt))
        assert headers["x-kvpeer-engine"] == "b"
        assert answer["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    prompt = fresh()  # pd: the prefill leg fails, the request goes decode-only
    answer, headers = post(pd.url, greedy(prompt))
    assert "x-kvpeer-source" not in headers
    assert answer["choices"][0]["token_ids"] == post(b, greedy(prompt))[0]["choices"][0][
        "token_ids"]

    fleet.restart("a")
    wait_for(lambda: shared.call(lambda: shared.router.health.healthy("a")), 30,
             "the router to see engine a again")
    # Judged restarted (its connections refused, its start time new), not a flap.
    judged = shared.call(shared.router.health.statistics)
    verdicts = dict(judged.verdicts)
    assert judged.restarts == 1, judged
    assert verdicts.get("witness_new", 0) + verdicts.get("refused", 0) == 1, judged
    client = OpenAIClient(shared.url, MODEL)
    # Long enough that a pull clearly pays even on the pair's first (cold) session.
    prompt = fresh(1536)
    computed = client.complete(prompt, OUT, {PIN: "a"})
    wait_indexed(shared, "a", prompt)  # the restarted engine's events, learned afresh
    pulled = client.complete(prompt, OUT, {PIN: "b"})
    policy: Any = shared.router.policy
    why = json.dumps(shared.call(policy.stats), sort_keys=True)
    assert pulled.headers.get("x-kvpeer-source") == "a", why
    assert pulled.tokens == computed.tokens
    client.close()
