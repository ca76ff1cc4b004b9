"""A router that says what it does: each engine's KV event feed on ``/metrics`` and in the
log, engines that never came up named, wildcard event endpoints refused, an access log,
the ``engine`` label on request series, the client's ``X-Request-Id`` kept, and a drain
on shutdown that keeps a long stream whole (issue 39, item 2)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpeer.errors import ConfigError
from kvpeer.lab.engines.fakeengine import FakeEngine
from kvpeer.router.app import ACCESS_LOGGER, Router
from kvpeer.router.config import from_mapping
from tests.router.conftest import fleet, make_config, read_events, run, until
from tests.router.test_flap import Publisher, batch, live, router_scenario


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": list(range(40)), "max_tokens": 3, **extra}


async def refused(url: str, timeout: float = 10.0) -> None:
    """Wait until nothing accepts a connection at ``url`` any more (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession() as fresh:
        while True:
            try:
                async with fresh.get(url + "/health") as resp:
                    await resp.read()
            except aiohttp.ClientConnectionError:
                return
            assert loop.time() < deadline, f"{url} still accepts connections"
            await asyncio.sleep(0.01)


def scrape(router: Router) -> dict[str, float]:
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(router.registry).decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


# --- the engines' KV event feeds ---------------------------------------------------------


def test_each_feed_is_on_metrics_and_a_refused_batch_is_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(router: Router, engine: FakeEngine, publisher: Publisher,
                   other: FakeEngine) -> None:
        metrics = scrape(router)
        assert metrics["kvpeer_router_feed_synced{engine=a}"] == 1
        assert metrics["kvpeer_router_feed_batches_applied_total{engine=a}"] == 3
        assert metrics["kvpeer_router_feed_replays_total{engine=a,result=completed}"] == 1
        assert "kvpeer_router_feed_synced{engine=b}" not in metrics  # b has no kv_events
        await until(lambda: any("engine a: KV events synced" in r.getMessage()
                                for r in caplog.records), "the synced line")
        # A batch the decoder refuses (what a new vLLM field would do): counted by
        # reason, the engine forgotten, and said in the log.
        await publisher.pub.send_multipart(live(3, b"\x93\xcb"))
        await until(lambda: scrape(router).get("kvpeer_router_feed_resets_total{engine=a}") == 1,
                    "the refused batch")
        dropped = {k: v for k, v in scrape(router).items()
                   if k.startswith("kvpeer_router_feed_dropped_total{engine=a,")}
        assert list(dropped.values()) == [1], dropped
        await until(lambda: any(r.levelno == logging.WARNING and "engine a: KV events lost: "
                                "dropped" in r.getMessage() for r in caplog.records),
                    "the line naming the loss")

    with caplog.at_level(logging.INFO, logger="kvpeer.router.app"):
        run(router_scenario(body))


def test_a_gap_is_counted_per_engine() -> None:
    async def body(router: Router, engine: FakeEngine, publisher: Publisher,
                   other: FakeEngine) -> None:
        await publisher.pub.send_multipart(live(5, batch(5)))  # 3 and 4 never came
        ident, start = await publisher.replay_request()
        assert start == 3
        await publisher.answer(ident, [(3, batch(3)), (4, batch(4))])
        await until(lambda: scrape(router).get(
            "kvpeer_router_feed_batches_applied_total{engine=a}") == 6, "the gap replayed")
        metrics = scrape(router)
        assert metrics["kvpeer_router_feed_gaps_total{engine=a}"] == 1
        assert metrics["kvpeer_router_feed_synced{engine=a}"] == 1

    run(router_scenario(body))


def test_an_engine_that_never_came_up_is_named_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        up, never = FakeEngine("a"), FakeEngine("b")
        await up.start()
        await never.start()
        config = make_config("shared", {"a": (up, "both"), "b": (never, "both")})
        await never.stop()  # its port is closed: nothing listens
        router = Router(config)
        await router.start()
        try:
            assert not router.health.healthy("b")
        finally:
            await router.stop()
            await up.stop()

    with caplog.at_level(logging.WARNING, logger="kvpeer.router.app"):
        run(scenario())
    assert any("engine(s) b not up at start" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557"])
@pytest.mark.parametrize("key", ["kv_events", "kv_events_replay"])
def test_a_wildcard_event_endpoint_is_refused_naming_it(key: str, endpoint: str) -> None:
    table = {"name": "a", "url": "http://10.0.0.5:8100", "peer": "10.0.0.5:5710",
             key: endpoint}
    with pytest.raises(ConfigError, match=f"{key} {endpoint!r}".replace("[", r"\[")
                       .replace("*", r"\*").replace("]", r"\]")):
        from_mapping({"mode": "shared", "engine": [table]})


# --- requests: the engine label, the access log, X-Request-Id ---------------------------


def test_the_access_log_names_engine_plan_and_ttft_and_the_client_request_id_is_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plans: list[str] = []

    async def scenario() -> None:
        async with fleet(settings={"access_log": True}) as f:
            async with f.client.post(f.url + "/v1/completions", json=completion_body(),
                                     headers={"X-Request-Id": "client-42"}) as resp:
                assert resp.status == 200
                assert resp.headers["X-Request-Id"] == "client-42"
                served = resp.headers["X-Kvpeer-Engine"]
                plans.append(resp.headers["X-Kvpeer-Plan"])
                await resp.read()
            (received,) = [r for r in f.engines[served].received
                           if r.path == "/v1/completions"]
            headers = {k.lower(): v for k, v in received.headers.items()}
            assert headers["x-request-id"] == "client-42"
            async with f.client.post(f.url + "/v1/completions", json=completion_body()) as resp:
                own = resp.headers["X-Request-Id"]  # none sent: the router's own id
                assert own == resp.headers["X-Kvpeer-Request-Id"]
                await resp.read()
            metrics = await f.metrics()
            key = f"kvpeer_router_ttft_seconds_count{{engine={served},mode=shared}}"
            assert metrics[key] >= 1

    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert len(lines) == 2
    fields = dict(part.split("=", 1) for part in lines[0].split() if "=" in part)
    assert fields["client_id"] == '"client-42"'
    assert fields["engine"] in ("a", "b")
    assert fields["outcome"] == "ok"
    assert fields["status"] == "200"
    assert json.loads(lines[0].split("plan=", 1)[1].split(" ttft_s=")[0]) == plans[0]
    assert float(fields["ttft_s"]) > 0
    assert "POST /v1/completions" in lines[0]


def test_no_access_log_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with fleet() as f:
            status, _ = await f.post("/v1/completions", completion_body())
            assert status == 200

    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        run(scenario())
    assert [r for r in caplog.records if r.name == ACCESS_LOGGER] == []


def test_a_request_no_engine_served_has_an_empty_engine_label() -> None:
    async def scenario() -> None:
        async with fleet() as f:
            async with f.client.post(f.url + "/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400
            metrics = await f.metrics()
            series = "kvpeer_router_requests_total{engine=,mode=shared,outcome=bad_request}"
            assert metrics[series] == 1

    run(scenario())


# --- the drain ----------------------------------------------------------------------------


def test_a_long_stream_stays_whole_across_a_router_stop() -> None:
    """Stop the router while a stream is mid-way: it stops listening at once, the stream
    goes on to its end, and only then does stop() return."""

    async def scenario() -> None:
        async with fleet(settings={"drain_timeout_s": 30}) as f:
            for fake in f.engines.values():
                fake.behaviour.hold_last = True
            async with f.client.post(f.url + "/v1/completions",
                                     json=completion_body(stream=True)) as resp:
                assert resp.status == 200
                events = read_events(resp)
                first = await anext(events)
                assert first.startswith(b"data: ")
                stopping = asyncio.create_task(f.router.stop())
                await refused(f.url)  # no new connection is taken while it drains...
                assert not stopping.done()  # ...and it waits for the stream
                for fake in f.engines.values():
                    fake.release_last.set()
                rest = [event async for event in events]
            assert rest[-1] == b"data: [DONE]"
            await asyncio.wait_for(stopping, 10)
            metrics = scrape(f.router)
            assert metrics["kvpeer_router_drained_requests_total{result=finished}"] == 1
            assert metrics.get("kvpeer_router_drained_requests_total{result=cut}", 0) == 0

    run(scenario())


def test_a_request_on_a_kept_alive_connection_while_draining_is_sent_away() -> None:
    async def scenario() -> None:
        async with fleet(settings={"drain_timeout_s": 30}) as f:
            idle = aiohttp.ClientSession()  # its connection stays open, idle, after this
            try:
                async with idle.post(f.url + "/v1/completions", json=completion_body()) as r:
                    assert r.status == 200
                    await r.read()
                for fake in f.engines.values():
                    fake.behaviour.hold_last = True
                async with f.client.post(f.url + "/v1/completions",
                                         json=completion_body(stream=True)) as resp:
                    events = read_events(resp)
                    await anext(events)
                    stopping = asyncio.create_task(f.router.stop())
                    await refused(f.url)
                    async with idle.post(f.url + "/v1/completions",
                                         json=completion_body()) as late:
                        assert late.status == 503  # the client sends it elsewhere
                        assert late.headers["Connection"] == "close"
                        await late.read()
                    for fake in f.engines.values():
                        fake.release_last.set()
                    assert [e async for e in events][-1] == b"data: [DONE]"
                await asyncio.wait_for(stopping, 10)
            finally:
                await idle.close()

    run(scenario())


def test_a_stream_longer_than_the_drain_is_cut_and_counted() -> None:
    async def scenario() -> None:
        async with fleet(settings={"drain_timeout_s": 0.2}) as f:
            for fake in f.engines.values():
                fake.behaviour.hold_last = True  # and never released
            async with f.client.post(f.url + "/v1/completions",
                                     json=completion_body(stream=True)) as resp:
                events = read_events(resp)
                await anext(events)
                await asyncio.wait_for(f.router.stop(), 10)
                with pytest.raises(aiohttp.ClientPayloadError):  # cut, not ended
                    _ = [event async for event in events]
            metrics = scrape(f.router)
            assert metrics["kvpeer_router_drained_requests_total{result=cut}"] == 1

    run(scenario())


def test_an_event_endpoint_whose_host_does_not_resolve_is_named_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        engine = FakeEngine("a")
        await engine.start()
        config = from_mapping({
            "mode": "shared", "listen": "127.0.0.1:0", "health_interval_s": 30,
            "engine": [{"name": "a", "url": engine.url, "peer": "127.0.0.1:5710",
                        "kv_events": "tcp://no-such-engine.invalid:5557"}]})
        router = Router(config)
        await router.start()
        try:
            await until(lambda: any("does not resolve" in r.getMessage()
                                    for r in caplog.records), "the warning")
        finally:
            await router.stop()
            await engine.stop()

    with caplog.at_level(logging.WARNING, logger="kvpeer.router.app"):
        run(scenario())
    (line,) = [r.getMessage() for r in caplog.records if "does not resolve" in r.getMessage()]
    assert line.startswith("engine a: kv_events tcp://no-such-engine.invalid:5557: host "
                           "'no-such-engine.invalid' does not resolve")
