"""The router's HTTP edge against fake engines, over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpeer.lab.engines.fakeengine import FakeEngine
from kvpeer.router.app import Router
from kvpeer.router.config import from_mapping
from kvpeer.router.policy import Plan
from tests.router.conftest import (
    RecordingPolicy,
    fleet,
    prefer,
    read_events,
    run,
    spawn_engine,
    until,
)

PROMPT = list(range(40))


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": PROMPT, "max_tokens": 3, **extra}


class TestPD:
    def test_prefill_leg_then_decode_leg_with_router_owned_params(self) -> None:
        async def scenario() -> None:
            async with fleet("pd", {"p": "prefill", "d": "decode"}) as f:
                status, answer = await f.post("/v1/completions", completion(temperature=0.5))
                assert status == 200
                assert answer["choices"][0]["text"]
                (pbody,) = f.engines["p"].generation_bodies()
                (dbody,) = f.engines["d"].generation_bodies()
                assert f.journal == ["p:start", "p:end", "d:start", "d:end"]
                kv_id = pbody["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
                assert pbody["max_tokens"] == 1
                assert pbody["stream"] is False
                assert pbody["prompt"] == PROMPT
                assert dbody["kv_transfer_params"] == {"remote_prefiller": {
                    "kv_request_id": kv_id, "remote_host": "127.0.0.1", "remote_port": 5710,
                    "prefill_done": True}}
                assert dbody["max_tokens"] == 3
                assert dbody["temperature"] == 0.5
                (outcome,) = f.policy.outcomes
                assert outcome.engine == "d"
                assert outcome.ok
                assert outcome.prefill_leg_s is not None

        run(scenario())

    def test_chat_prefill_leg_caps_completion_tokens_and_client_streams_from_decode(
        self,
    ) -> None:
        async def scenario() -> None:
            async with fleet("pd", {"p": "prefill", "d": "decode"}) as f:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "max_completion_tokens": 3, "stream": True, "min_tokens": 2}
                async with f.client.post(f.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    events = [e async for e in read_events(resp)]
                assert events[-1] == b"data: [DONE]"
                (pbody,) = f.engines["p"].generation_bodies()
                assert pbody["max_completion_tokens"] == 1
                assert "min_tokens" not in pbody
                assert pbody["stream"] is False
                (dbody,) = f.engines["d"].generation_bodies()
                assert dbody["stream"] is True
                assert dbody["min_tokens"] == 2

        run(scenario())

    @pytest.mark.parametrize("failure", ["status_500", "status_400", "down"])
    def test_failed_prefill_leg_falls_back_to_decode_only(self, failure: str) -> None:
        async def scenario() -> None:
            async with fleet("pd", {"p": "prefill", "d": "decode"}) as f:
                if failure == "down":
                    await f.engines["p"].stop()
                else:
                    f.engines["p"].behaviour.fail_status = int(failure.split("_")[1])
                status, _ = await f.post("/v1/completions", completion())
                assert status == 200
                (dbody,) = f.engines["d"].generation_bodies()
                assert "kv_transfer_params" not in dbody
                metrics = await f.metrics()
                assert metrics["kvpeer_router_fallbacks_total"] == 1
                assert metrics["kvpeer_router_requests_total{engine=d,mode=pd,outcome=ok}"] == 1

        run(scenario())

    def test_dp_ranks_behind_one_url_get_the_rank_header_and_port_plus_rank(self) -> None:
        async def scenario() -> None:
            p, d = FakeEngine("p"), FakeEngine("d")
            await p.start()
            await d.start()
            config = from_mapping({"mode": "pd", "listen": "127.0.0.1:0", "engine": [
                {"name": "p", "url": p.url, "peer": "127.0.0.1:6000", "role": "prefill",
                 "dp_size": 2},
                {"name": "d", "url": d.url, "peer": "127.0.0.1:7000", "role": "decode"}]})
            policy = RecordingPolicy(config.specs, config.mode,
                                     lambda loads: Plan(engine="d", prefill_engine="p-dp1"))
            router = Router(config, policy)
            await router.start()
            try:
                async with aiohttp.ClientSession() as client, client.post(
                        router.url + "/v1/completions", json=completion()) as resp:
                    assert resp.status == 200
                (record,) = [r for r in p.received if r.path == "/v1/completions"]
                assert record.headers["X-data-parallel-rank"] == "1"
                (dbody,) = d.generation_bodies()
                assert dbody["kv_transfer_params"]["remote_prefiller"]["remote_port"] == 6001
            finally:
                await router.stop()
                await p.stop()
                await d.stop()

        run(scenario())


class TestShared:
    def test_policy_source_is_named_in_remote_kv_source(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=lambda loads: Plan(engine="a", source="b")) as f:
                status, _ = await f.post("/v1/completions", completion())
                assert status == 200
                (body,) = f.engines["a"].generation_bodies()
                assert body["kv_transfer_params"]["remote_kv_source"]["remote_host"] == "127.0.0.2"
                assert body["kv_transfer_params"]["remote_kv_source"]["remote_port"] == 5711
                assert "held_tokens" not in body["kv_transfer_params"]["remote_kv_source"]
                assert f.engines["b"].generation_bodies() == []

        run(scenario())

    def test_the_source_held_tokens_go_to_the_consumer_uncapped(self) -> None:
        """The plan's prediction stops a block short of a prompt held whole; the leg
        names all the source holds, so the consumer loads the last block too."""

        async def scenario() -> None:
            plan = Plan(engine="a", source="b", predicted_cached_tokens=1504,
                        predicted_pulled_tokens=1504, source_held_tokens=1536)  # fmt: skip
            async with fleet(choose=lambda loads: plan) as f:
                status, _ = await f.post("/v1/completions", completion())
                assert status == 200
                (body,) = f.engines["a"].generation_bodies()
                assert body["kv_transfer_params"]["remote_kv_source"]["held_tokens"] == 1536

        run(scenario())

    @pytest.mark.parametrize("source", ["a", "nobody", "b-down"])
    def test_a_source_the_router_may_not_name_is_dropped(self, source: str) -> None:
        async def scenario() -> None:
            named = "b" if source == "b-down" else source
            async with fleet(choose=lambda loads: Plan(engine="a", source=named)) as f:
                if source == "b-down":
                    f.engines["b"].behaviour.health_status = 500
                    await f.router.health.check_once(f.router.session)
                status, _ = await f.post("/v1/completions", completion())
                assert status == 200
                (body,) = f.engines["a"].generation_bodies()
                assert "kv_transfer_params" not in body
                metrics = await f.metrics()
                assert metrics["kvpeer_router_policy_errors_total{kind=invalid_peer}"] == 1

        run(scenario())

    def test_a_policy_that_raises_costs_the_request_nothing(self) -> None:
        async def scenario() -> None:
            async with fleet() as f:
                f.policy.raises = True
                status, _ = await f.post("/v1/completions", completion())
                assert status == 200
                metrics = await f.metrics()
                assert metrics["kvpeer_router_policy_errors_total{kind=raised}"] == 1

        run(scenario())


class TestClientCannotRoute:
    """The attacker's view: a client names a host in kv_transfer_params; no engine sees it."""

    @pytest.mark.parametrize("mode", ["pd", "shared"])
    @pytest.mark.parametrize("stream", [False, True])
    def test_client_kv_transfer_params_never_reach_an_engine(
        self, mode: str, stream: bool
    ) -> None:
        evil = {"kv_request_id": "x", "remote_host": "10.0.0.1", "remote_port": 1}

        async def scenario() -> None:
            roles = {"a": "prefill", "b": "decode"} if mode == "pd" else None
            async with fleet(mode, roles) as f:
                for key in ("remote_kv_source", "remote_prefiller", "remote_decoder"):
                    body = completion(stream=stream, kv_transfer_params={key: evil},
                                      ec_transfer_params={key: evil},
                                      vllm_xargs={"kv_transfer_params": json.dumps(evil)})
                    async with f.client.post(f.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        await resp.read()
                seen = [r.body for e in f.engines.values() for r in e.received]
                assert seen
                assert all("10.0.0.1" not in json.dumps(b) for b in seen)
                assert all("ec_transfer_params" not in b for b in seen)
                metrics = await f.metrics()
                assert metrics["kvpeer_router_client_kv_params_stripped_total"] == 3

        run(scenario())


class TestFailures:
    def test_an_unhealthy_engine_is_routed_around_until_it_answers_again(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b"),
                             settings={"health_interval_s": 0.05}) as f:
                f.engines["a"].behaviour.health_status = 503
                await f.router.health.wait_for(lambda h: not h.healthy("a"), 5)
                for _ in range(3):
                    assert (await f.post("/v1/completions", completion()))[0] == 200
                assert f.engines["a"].generation_bodies() == []
                assert len(f.engines["b"].generation_bodies()) == 3
                f.engines["a"].behaviour.health_status = 200
                await f.router.health.wait_for(lambda h: h.healthy("a"), 5)
                assert (await f.post("/v1/completions", completion()))[0] == 200
                assert len(f.engines["a"].generation_bodies()) == 1
                # Up, down, up, with the same start time: a flap, what it holds is kept.
                assert f.policy.restarts == []

        run(scenario())

    def test_an_engine_restarted_on_its_port_is_reported_to_the_policy(self) -> None:
        async def scenario() -> None:
            async with fleet(settings={"health_interval_s": 0.05}) as f:
                old = f.engines["a"]
                port = old.port
                await old.stop()
                await f.router.health.wait_for(lambda h: not h.healthy("a"), 5)
                new = FakeEngine("a")
                await new.start(port=port)
                f.engines["a"] = new
                await f.router.health.wait_for(lambda h: h.healthy("a"), 5)
                assert f.policy.restarts == ["a"]
                metrics = await f.metrics()
                assert metrics["kvpeer_router_engine_restarts_total"] == 1

        run(scenario())

    def test_with_no_engine_healthy_one_down_but_not_gone_is_tried(self) -> None:
        """Rule 6 of router/app.py. Engine b misses its health checks but still serves
        (under load in CI: one slow /health), and a is gone (its port refuses): the
        request goes to b instead of a 503. With b gone too, a 503."""

        async def scenario() -> None:
            settings = {"health_interval_s": 0.05, "health_timeout_s": 0.2}
            async with fleet(settings=settings) as f:
                health = f.router.health
                f.engines["b"].behaviour.health_delay_s = 1.0  # a loaded API server
                await health.wait_for(lambda h: not h.healthy("b"), 5)
                await f.engines["a"].stop()
                await until(lambda: not health.healthy("a") and not health.reachable("a"),
                            "a's port to refuse")  # fmt: skip
                assert health.reachable("b")
                status, _ = await f.post("/v1/completions", completion())
                assert status == 200
                assert len(f.engines["b"].generation_bodies()) == 1
                metrics = await f.metrics()
                assert metrics["kvpeer_router_last_resort_total"] == 1
                # An engine that answers its check with an error says it is unwell: not tried.
                f.engines["b"].behaviour.health_status = 503
                f.engines["b"].behaviour.health_delay_s = 0.0
                await until(lambda: not health.reachable("b"), "b's check to answer 503")
                status, _ = await f.post("/v1/completions", completion())
                assert status == 503
                f.engines["b"].behaviour.health_status = 200
                f.engines["b"].behaviour.health_delay_s = 1.0
                await until(lambda: health.reachable("b"), "b's check to time out again")
                await f.engines["b"].stop()
                await until(lambda: not health.reachable("b"), "b's port to refuse")
                status, answer = await f.post("/v1/completions", completion())
                assert status == 503, answer
                assert answer["error"]["message"] == "no healthy engine"

        run(scenario())

    def test_5xx_before_the_first_byte_is_retried_elsewhere_4xx_passes_through(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b")) as f:
                f.engines["a"].behaviour.fail_status = 503
                f.engines["a"].behaviour.fail_count = 1
                status, _ = await f.post("/v1/completions", completion())
                assert status == 200
                assert len(f.engines["b"].generation_bodies()) == 1
                f.engines["a"].behaviour.fail_status = 400
                f.engines["a"].behaviour.fail_count = None
                status, answer = await f.post("/v1/completions", completion())
                assert status == 400
                assert answer["error"]["message"] == "a told to fail"
                assert len(f.engines["b"].generation_bodies()) == 1  # not retried
                metrics = await f.metrics()
                assert metrics["kvpeer_router_retries_total"] == 1
                assert metrics["kvpeer_router_upstream_errors_total{reason=status_5xx}"] == 1
                passed = "kvpeer_router_requests_total{engine=a,mode=shared,outcome=client_error}"
                assert metrics[passed] == 1

        run(scenario())

    def test_retries_are_bounded_and_the_last_5xx_reaches_the_client(self) -> None:
        async def scenario() -> None:
            roles = {"a": "both", "b": "both", "c": "both"}
            async with fleet(roles=roles, settings={"retries": 1}) as f:
                for engine in f.engines.values():
                    engine.behaviour.fail_status = 500
                status, _ = await f.post("/v1/completions", completion())
                assert status == 500
                tried = sum(len(e.generation_bodies()) for e in f.engines.values())
                assert tried == 2

        run(scenario())

    def test_a_hung_engine_is_abandoned_before_the_first_byte(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b"), settings={"read_timeout_s": 0.3}) as f:
                f.engines["a"].behaviour.hang = True
                status, _ = await f.post("/v1/completions", completion(stream=True))
                assert status == 200
                assert len(f.engines["b"].generation_bodies()) == 1
                metrics = await f.metrics()
                assert metrics["kvpeer_router_upstream_errors_total{reason=timeout}"] == 1

        run(scenario())

    def test_no_healthy_engine_is_503_not_a_hang(self) -> None:
        async def scenario() -> None:
            async with fleet() as f:
                for engine in f.engines.values():
                    engine.behaviour.health_status = 500
                await f.router.health.check_once(f.router.session)
                status, answer = await f.post("/v1/completions", completion())
                assert status == 503
                assert answer["error"]["type"] == "service_unavailable"
                async with f.client.get(f.url + "/health") as resp:
                    assert resp.status == 503

        run(scenario())

    def test_mid_stream_drop_ends_the_client_stream_with_an_error(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b")) as f:
                f.engines["a"].behaviour.drop_after_chunks = 1
                async with f.client.post(f.url + "/v1/completions",
                                         json=completion(stream=True)) as resp:
                    assert resp.status == 200
                    events = [e async for e in read_events(resp)]
                assert len(events) == 2
                assert b'"t0 "' in events[0]
                assert json.loads(events[1][len(b"data: "):])["error"]["code"] == 502
                assert f.engines["b"].generation_bodies() == []  # never retried after a byte
                (outcome,) = f.policy.outcomes
                assert not outcome.ok
                assert f.router.statistics().in_flight == {"a": 0, "b": 0}

        run(scenario())

    def test_an_engine_silent_mid_stream_ends_the_client_stream_after_the_read_timeout(
        self,
    ) -> None:
        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b"), settings={"read_timeout_s": 0.3}) as f:
                f.engines["a"].behaviour.hold_last = True  # and never released
                async with f.client.post(f.url + "/v1/completions",
                                         json=completion(stream=True)) as resp:
                    events = [e async for e in read_events(resp)]
                assert b'"t1 "' in events[1]
                assert json.loads(events[-1][len(b"data: "):])["error"]["code"] == 502
                metrics = await f.metrics()
                ended = "kvpeer_router_requests_total{engine=a,mode=shared,outcome=stream_error}"
                assert metrics[ended] == 1

        run(scenario())

    def test_pd_retry_keeps_the_prefill_engine_that_ran(self) -> None:
        async def scenario() -> None:
            roles = {"p": "prefill", "d1": "decode", "d2": "decode"}
            async with fleet("pd", roles, choose=prefer("d1", "d2", prefill_engine="p")) as f:
                f.engines["d1"].behaviour.fail_status = 503
                status, _ = await f.post("/v1/completions", completion())
                assert status == 200
                (first,) = f.engines["d1"].generation_bodies()
                (second,) = f.engines["d2"].generation_bodies()
                assert first["kv_transfer_params"] == second["kv_transfer_params"]
                assert len(f.engines["p"].generation_bodies()) == 1  # one prefill leg
                assert [plan.prefill_engine for plan in f.policy.sent] == ["p", "p"]

        run(scenario())

    def test_killed_engine_process_retry_before_first_byte_and_mid_stream(self) -> None:
        """Real process death (SIGKILL): before the first byte it is retried; after, the
        client's stream ends with an error event rather than hanging."""

        async def scenario() -> None:
            a, b = await spawn_engine(), await spawn_engine()
            config = from_mapping({"mode": "shared", "listen": "127.0.0.1:0",
                                   "health_interval_s": 60, "engine": [
                                       {"name": "a", "url": a.url, "peer": "127.0.0.1:5710"},
                                       {"name": "b", "url": b.url, "peer": "127.0.0.1:5711"}]})
            policy = RecordingPolicy(config.specs, config.mode, prefer("a", "b"))
            router = Router(config, policy)
            await router.start()
            try:
                async with aiohttp.ClientSession() as client:
                    async with client.post(b.url + "/_fake/behaviour",
                                           json={"hold_last": True}) as resp:
                        assert resp.status == 200
                    a.kill()
                    await a.process.wait()
                    async with client.post(router.url + "/v1/completions",
                                           json=completion()) as resp:
                        assert resp.status == 200
                    assert not router.health.healthy("a")  # marked down by the request
                    async with client.post(router.url + "/v1/completions",
                                           json=completion(stream=True)) as resp:
                        events = read_events(resp)
                        first = await anext(events)
                        assert b'"t0 "' in first
                        b.kill()  # the last chunk is held: b dies mid-stream
                        rest = [e async for e in events]
                    assert rest[-1].startswith(b"data: {\"error\"")
                    metrics = await client.get(router.url + "/metrics")
                    text = await metrics.text()
                    assert "kvpeer_router_retries_total 1.0" in text
            finally:
                await router.stop()
                await a.close()
                await b.close()

        run(scenario())


class TestStreaming:
    def test_chunks_reach_the_client_before_the_engine_sends_its_last(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b")) as f:
                engine = f.engines["a"]
                engine.behaviour.hold_last = True
                async with f.client.post(f.url + "/v1/completions",
                                         json=completion(stream=True)) as resp:
                    events = read_events(resp)
                    first = await anext(events)
                    second = await anext(events)
                    assert b'"t0 "' in first
                    assert b'"t1 "' in second
                    assert engine.journal[-1] == "a:start"  # the last chunk is still held
                    engine.release_last.set()
                    rest = [e async for e in events]
                assert b'"t2 "' in rest[0]
                assert rest[-1] == b"data: [DONE]"

        run(scenario())

    def test_usage_the_router_asked_for_is_read_and_stripped(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b")) as f:
                f.engines["a"].behaviour.cached_tokens = 32
                async with f.client.post(f.url + "/v1/completions",
                                         json=completion(stream=True)) as resp:
                    events = [e async for e in read_events(resp)]
                assert not any(b'"usage"' in e for e in events)
                assert events[-1] == b"data: [DONE]"
                (body,) = f.engines["a"].generation_bodies()
                assert body["stream_options"] == {"include_usage": True}
                (outcome,) = f.policy.outcomes
                assert outcome.cached_tokens == 32
                assert outcome.prompt_tokens == len(PROMPT)
                assert outcome.ttft_s is not None

        run(scenario())

    def test_usage_the_client_asked_for_is_kept(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b")) as f:
                f.engines["a"].behaviour.cached_tokens = 16
                body = completion(stream=True, stream_options={"include_usage": True})
                async with f.client.post(f.url + "/v1/completions", json=body) as resp:
                    events = [e async for e in read_events(resp)]
                usage = [json.loads(e[6:]) for e in events if b'"usage"' in e]
                assert usage[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
                assert f.policy.outcomes[0].cached_tokens == 16

        run(scenario())

    def test_a_client_that_leaves_mid_stream_frees_the_engine_slot(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b")) as f:
                engine = f.engines["a"]
                engine.behaviour.hold_last = True
                async with f.client.post(f.url + "/v1/completions",
                                         json=completion(stream=True)) as resp:
                    await anext(read_events(resp))
                    resp.close()  # the client goes away with the last chunk unsent
                await asyncio.wait_for(f.policy.outcome_seen.wait(), 5)
                assert f.policy.outcomes[0].ok is False
                assert f.router.statistics().in_flight["a"] == 0

        run(scenario())

    def test_a_client_gone_before_the_streams_end_is_an_ok_request(
        self, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Found by the serving benchmark: a client that closed its connection after
        ``[DONE]`` made the router's last write, the stream's end, raise "Cannot write to
        closing transport", logged by aiohttp as an error of the request. The answer was
        whole: it counts as ok and nothing is logged as an error. (The closed transport is
        simulated on the router's answer, which alone carries ``X-Kvpeer-Request-Id``.)"""
        original = web.StreamResponse.write_eof

        async def closing(response: web.StreamResponse, data: bytes = b"") -> None:
            if "X-Kvpeer-Request-Id" in response.headers:
                raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
            await original(response, data)

        monkeypatch.setattr(web.StreamResponse, "write_eof", closing)

        async def scenario() -> None:
            async with fleet(choose=prefer("a", "b")) as f:
                async with f.client.post(f.url + "/v1/completions",
                                         json=completion(stream=True)) as resp:
                    events = []
                    async for event in read_events(resp):
                        events.append(event)
                        if event == b"data: [DONE]":
                            break
                    resp.close()
                await asyncio.wait_for(f.policy.outcome_seen.wait(), 5)
                assert events[-1] == b"data: [DONE]"
                assert f.policy.outcomes[0].ok is True
                assert f.router.statistics().in_flight["a"] == 0

        with caplog.at_level(logging.ERROR):
            run(scenario())
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


class TestEndpoints:
    def test_metrics_scrape_parses(self) -> None:
        async def scenario() -> None:
            async with fleet() as f:
                await f.post("/v1/completions", completion(stream=True))
                await f.post("/v1/completions", completion())
                metrics = await f.metrics()
                served = [f"engine={name}" for name in ("a", "b")]  # by load: either
                for series in ("requests_total{%s,mode=shared,outcome=ok}",
                               "request_duration_seconds_count{%s,mode=shared}",
                               "ttft_seconds_count{%s,mode=shared}"):
                    counts = [metrics.get("kvpeer_router_" + series % e, 0) for e in served]
                    assert sum(counts) == 2, series
                assert metrics["kvpeer_router_engines_healthy"] == 2
                assert metrics["kvpeer_router_engine_up{engine=a}"] == 1
                assert metrics["kvpeer_router_policy_predicted_cached_tokens"] == 7
                assert metrics["kvpeer_router_actual_cached_tokens_total"] == 0

        run(scenario())

    def test_health_and_models(self) -> None:
        async def scenario() -> None:
            async with fleet() as f:
                async with f.client.get(f.url + "/health") as resp:
                    assert resp.status == 200
                    assert (await resp.json())["up"] == ["a", "b"]
                async with f.client.get(f.url + "/v1/models") as resp:
                    assert resp.status == 200
                    assert (await resp.json())["data"][0]["id"] == "fake-model"

        run(scenario())

    def test_bad_json_is_a_400(self) -> None:
        async def scenario() -> None:
            async with fleet() as f:
                async with f.client.post(f.url + "/v1/completions", data=b"{nope") as resp:
                    assert resp.status == 400
                status, _ = await f.post("/v1/completions", [1, 2])  # type: ignore[arg-type]
                assert status == 400

        run(scenario())

    def test_text_prompts_are_tokenized_and_a_failed_tokenize_routes_by_load(self) -> None:
        async def scenario() -> None:
            async with fleet() as f:
                status, _ = await f.post("/v1/completions", {"model": "m", "prompt": "abc"})
                assert status == 200
                assert f.policy.plans[-1][1] == [97, 98, 99]
                for engine in f.engines.values():
                    engine.behaviour.tokenize_status = 500
                status, _ = await f.post("/v1/chat/completions", {
                    "model": "m", "messages": [{"role": "user", "content": "x"}]})
                assert status == 200
                assert f.policy.plans[-1][1] == []
                metrics = await f.metrics()
                assert metrics["kvpeer_router_tokenize_failures_total"] == 1

        run(scenario())


def test_kvpeer_router_command_serves_and_exits_cleanly_on_sigterm() -> None:
    async def scenario() -> None:
        engine = FakeEngine("e0")
        await engine.start()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvpeer.cli", "router", "--listen", "127.0.0.1:0",
            "--engine", f"e0={engine.url},peer=127.0.0.1:5710",
            stderr=asyncio.subprocess.PIPE, start_new_session=True, env=env,
        )
        assert process.stderr is not None
        try:
            line = b""
            while b" on http://" not in line:
                line = await asyncio.wait_for(process.stderr.readline(), 30)
                assert line, "router exited before listening"
            url = line.decode().rsplit(" on ", 1)[1].strip()
            async with aiohttp.ClientSession() as client, client.post(
                    url + "/v1/completions", json=completion()) as resp:
                assert resp.status == 200
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 15) == 0
        finally:
            if process.returncode is None:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
            await engine.stop()

    run(scenario())
