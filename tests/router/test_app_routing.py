"""What the router tells clients about a request's route, pinning, and the prefill leg's
own deadline (fake engines, real loopback HTTP)."""

from __future__ import annotations

from typing import Any

import aiohttp

from kvpeer.router.policy import Plan
from tests.router.conftest import fleet, run

PROMPT = list(range(40))
BODY: dict[str, Any] = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 3}


class TestPinning:
    def test_a_pinned_request_is_served_by_that_engine(self) -> None:
        async def scenario() -> None:
            async with fleet(settings={"allow_pinning": True}) as f:
                for target in ("b", "a", "b"):
                    async with f.client.post(f.url + "/v1/completions", json=BODY,
                                             headers={"X-Kvpeer-Engine": target}) as resp:
                        assert resp.status == 200
                        assert resp.headers["X-Kvpeer-Engine"] == target
                assert len(f.engines["b"].generation_bodies()) == 2
                assert len(f.engines["a"].generation_bodies()) == 1

        run(scenario())

    def test_pinning_an_unknown_engine_is_a_400_naming_it(self) -> None:
        async def scenario() -> None:
            async with fleet(settings={"allow_pinning": True}) as f:
                async with f.client.post(f.url + "/v1/completions", json=BODY,
                                         headers={"X-Kvpeer-Engine": "zz"}) as resp:
                    assert resp.status == 400
                    assert "'zz'" in (await resp.json())["error"]["message"]
                assert f.engines["a"].generation_bodies() == []

        run(scenario())

    def test_without_allow_pinning_the_header_is_ignored(self) -> None:
        async def scenario() -> None:
            async with fleet(choose=lambda loads: Plan(engine="a")) as f:
                async with f.client.post(f.url + "/v1/completions", json=BODY,
                                         headers={"X-Kvpeer-Engine": "b"}) as resp:
                    assert resp.status == 200
                    assert resp.headers["X-Kvpeer-Engine"] == "a"
                assert f.engines["b"].generation_bodies() == []

        run(scenario())

    def test_a_pinned_source_reaches_the_policy_and_an_unknown_one_is_a_400(self) -> None:
        async def scenario() -> None:
            async with fleet(settings={"allow_pinning": True}) as f:
                url = f.url + "/v1/completions"
                async with f.client.post(url, json=BODY,
                                         headers={"X-Kvpeer-Source": "b"}) as resp:
                    assert resp.status == 200
                async with f.client.post(url, json=BODY,
                                         headers={"X-Kvpeer-Source": "zz"}) as resp:
                    assert resp.status == 400
                    assert "X-Kvpeer-Source: no engine named 'zz'" in (
                        await resp.json())["error"]["message"]
                assert f.policy.pulls_pinned == ["b"]
            async with fleet() as f:  # without allow_pinning: ignored
                async with f.client.post(f.url + "/v1/completions", json=BODY,
                                         headers={"X-Kvpeer-Source": "zz"}) as resp:
                    assert resp.status == 200
                assert f.policy.pulls_pinned == [None]

        run(scenario())


class TestRouteHeaders:
    def test_shared_names_the_source_and_pd_the_prefill_leg(self) -> None:
        async def scenario() -> None:
            shared = fleet(choose=lambda loads: Plan(engine="a", source="b", reason="pull",
                                                     predicted_ttft_s=0.25))
            async with shared as f:
                stream = {**BODY, "stream": True}
                async with f.client.post(f.url + "/v1/completions", json=stream) as resp:
                    assert resp.status == 200
                    assert resp.headers["X-Kvpeer-Source"] == "b"
                    assert "X-Kvpeer-Prefill-Seconds" not in resp.headers
                    # the plan against its outcome: why, and what it predicted
                    assert resp.headers["X-Kvpeer-Plan"] == "pull"
                    assert float(resp.headers["X-Kvpeer-Predicted-Ttft-Seconds"]) == 0.25
                    await resp.read()
            async with fleet("pd", {"p": "prefill", "d": "decode"}) as f:
                reply = await f.client.post(f.url + "/v1/completions", json=BODY)
                async with reply as resp:
                    assert resp.status == 200
                    assert resp.headers["X-Kvpeer-Engine"] == "d"
                    assert resp.headers["X-Kvpeer-Source"] == "p"
                    assert float(resp.headers["X-Kvpeer-Prefill-Seconds"]) > 0

        run(scenario())

    def test_an_engines_kv_transfer_params_never_reach_the_client(self) -> None:
        async def scenario() -> None:
            async with fleet() as f:
                for engine in f.engines.values():
                    engine.behaviour.answer_kv_params = {"remote_host": "10.1.2.3"}
                status, answer = await f.post("/v1/completions", BODY)
                assert status == 200
                assert "kv_transfer_params" not in answer
                assert answer["usage"]["prompt_tokens"] == len(PROMPT)

        run(scenario())


def test_a_prefill_leg_past_its_deadline_goes_decode_only() -> None:
    async def scenario() -> None:
        settings = {"prefill_timeout_s": 0.3}
        async with fleet("pd", {"p": "prefill", "d": "decode"}, settings=settings) as f:
            f.engines["p"].behaviour.hang = True
            status, _ = await f.post("/v1/completions", BODY)
            assert status == 200
            (dbody,) = f.engines["d"].generation_bodies()
            assert "kv_transfer_params" not in dbody
            metrics = await f.metrics()
            assert metrics["kvpeer_router_fallbacks_total"] == 1
            assert metrics["kvpeer_router_upstream_errors_total{reason=timeout}"] == 1

    run(scenario())


def test_the_default_policy_is_the_decision_core_and_its_numbers_are_scraped() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvpeer.lab.engines.fakeengine import FakeEngine
    from kvpeer.router.app import Router
    from kvpeer.router.decide import RouterPolicy
    from tests.router.conftest import make_config

    async def scenario() -> None:
        fakes = {name: FakeEngine(name) for name in "ab"}
        for fake in fakes.values():
            await fake.start()
        router = Router(make_config("shared", {n: (f, "both") for n, f in fakes.items()}))
        assert isinstance(router.policy, RouterPolicy)
        await router.start()
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(router.url + "/v1/completions",
                                       json={**BODY, "stream": True}) as resp:
                    assert resp.status == 200
                    await resp.read()
                async with client.get(router.url + "/metrics") as resp:
                    text = await resp.text()
        finally:
            await router.stop()
            for fake in fakes.values():
                await fake.stop()
        families = {family.name: family for family in text_string_to_metric_families(text)}
        samples = {
            (s.name, s.labels.get("reason") or s.labels.get("engine")): s.value
            for family in families.values()
            for s in family.samples
        }
        assert samples[("kvpeer_router_policy_plans_total", None)] == 1
        assert samples[("kvpeer_router_policy_plans_by_reason_total", "load")] == 1
        assert samples[("kvpeer_router_policy_outcomes_warmup_total", None)] == 1
        assert samples[("kvpeer_router_policy_prefill_seconds_per_token", "*")] > 0
        # counters are counters (they were gauges named *_total)
        assert families["kvpeer_router_policy_plans"].type == "counter"
        assert families["kvpeer_router_policy_plans_by_reason"].type == "counter"

    run(scenario())
