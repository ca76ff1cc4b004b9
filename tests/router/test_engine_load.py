"""Routers that share engines see each other's load (``kvpeer.router.engineload``).

Parsing what an engine reports (hostile values ignored), folding it into one router's
count, ignoring stale reports, and two real routers in front of the same fake engines:
the second router steers away from the engine the first has loaded, which it cannot see
without the engines' reports.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvpeer.lab.engines.fakeengine import Behaviour, FakeEngine
from kvpeer.router.app import Router
from kvpeer.router.config import EngineEntry, from_mapping
from kvpeer.router.engineload import EngineLoadFeed, parse_reported
from kvpeer.router.policy import EngineSpec
from tests.router.conftest import engine_table

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0
vllm:num_requests_running_total 77
"""


def test_the_two_scheduler_gauges_are_read_per_engine_label() -> None:
    assert parse_reported(VLLM_PAGE) == {"0": (3.0, 2.0), "1": (1.0, 0.0)}
    assert parse_reported("vllm:num_requests_running 4\n") == {"": (4.0, 0.0)}


@pytest.mark.parametrize(
    "value", ["nan", "NaN", "inf", "+Inf", "-1", "1e12", "four", "0x10", ""]
)
def test_a_hostile_engine_value_is_ignored(value: str) -> None:
    page = f'vllm:num_requests_running{{engine="0"}} {value}\nvllm:num_requests_waiting 1\n'
    assert parse_reported(page) == {"": (0.0, 1.0)}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def feed_for(url: str, own: dict[str, tuple[int, int]], clock: Clock,
             dp_ranks: int = 0) -> EngineLoadFeed:  # fmt: skip
    if dp_ranks:
        entries = [EngineEntry(EngineSpec(f"e-dp{r}", url, "127.0.0.1", 5710 + r), r)
                   for r in range(dp_ranks)]  # fmt: skip
    else:
        entries = [EngineEntry(EngineSpec("e", url, "127.0.0.1", 5710))]
    return EngineLoadFeed(entries, own.__getitem__, interval_s=1.0, timeout_s=1.0, clock=clock)


async def scrape(feed: EngineLoadFeed) -> None:
    async with aiohttp.ClientSession() as session:
        await feed.scrape_once(session)


@contextlib.asynccontextmanager
async def serving(page: str, status: int = 200) -> AsyncIterator[str]:
    from aiohttp import web

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=page, status=status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_reports_fold_into_the_routers_own_count_until_they_go_stale() -> None:
    async def scenario() -> None:
        clock = Clock()
        own = {"e": (1, 1)}  # this router: one request there, not answered yet
        async with serving(VLLM_PAGE) as url:
            feed = feed_for(url, own, clock)
            await scrape(feed)
        # every engine label summed: 4 running + 2 waiting; 5 of them another router's
        assert feed.combine("e", 1, 1000, 1500.0) == (1 + 5, 1000 + 1 * 1500)
        own["e"] = (0, 0)
        assert feed.combine("e", 0, 0, 1500.0) == (5, 1500)  # theirs still count
        clock.now += 3.5  # older than three scrape intervals: only our own count
        assert feed.combine("e", 0, 0, 1500.0) == (0, 0)
        assert feed.report("e") is None

    asyncio.run(scenario())


def test_one_router_alone_changes_nothing_and_dp_ranks_read_their_label() -> None:
    async def scenario() -> None:
        clock = Clock()
        async with serving(VLLM_PAGE) as url:
            alone = feed_for(url, {"e": (6, 2)}, clock)  # it sent all six itself
            await scrape(alone)
            ranks = feed_for(url, {"e-dp0": (0, 0), "e-dp1": (0, 0)}, clock, dp_ranks=2)
            await scrape(ranks)
        assert alone.combine("e", 6, 3000, 1500.0) == (6, 3000)
        assert ranks.combine("e-dp0", 0, 0, 100.0) == (5, 200)
        assert ranks.combine("e-dp1", 0, 0, 100.0) == (1, 0)

    asyncio.run(scenario())


def test_a_failed_scrape_is_counted_and_leaves_no_report() -> None:
    async def scenario() -> None:
        clock = Clock()
        async with serving(VLLM_PAGE, status=500) as url:
            feed = feed_for(url, {"e": (0, 0)}, clock)
            await scrape(feed)
        await scrape(feed)  # and the engine is gone: refused
        assert feed.report("e") is None
        assert feed.statistics()["scrape_failures_total"] == 2.0

    asyncio.run(scenario())


def test_a_second_router_steers_away_from_the_engine_the_first_one_loaded() -> None:
    """Router 1 holds four streams on engine a. Router 2 has sent nothing; with the
    engines' reports it places its next requests on b, without them (interval 0) it sees
    two idle engines and breaks the tie by name, onto the loaded a."""

    async def scenario(interval: float) -> list[str]:
        a = FakeEngine("a", Behaviour(hold_last=True, chunks=2))
        b = FakeEngine("b")
        for fake in (a, b):
            await fake.start()
        tables = [engine_table("a", a, 0), engine_table("b", b, 1)]

        def router() -> Router:
            return Router(from_mapping({
                "mode": "shared", "listen": "127.0.0.1:0", "engine": tables,
                "health_interval_s": 30, "allow_pinning": True,
                "load_scrape_interval_s": interval}))  # fmt: skip

        first, second = router(), router()
        await first.start()
        await second.start()
        served: list[str] = []
        try:
            async with aiohttp.ClientSession() as client:
                body = {"model": "fake-model", "prompt": "t1 t2 t3", "max_tokens": 2,
                        "stream": True}  # fmt: skip
                held = [asyncio.create_task(client.post(
                    first.url + "/v1/completions", json=body,
                    headers={"X-Kvpeer-Engine": "a"})) for _ in range(4)]  # fmt: skip
                while a.running < 4:
                    await asyncio.sleep(0.01)
                if second.engine_load is not None:
                    await second.engine_load.scrape_once(second.session)
                for _ in range(3):
                    async with client.post(second.url + "/v1/completions",
                                           json={**body, "stream": False}) as resp:
                        assert resp.status == 200
                        served.append(resp.headers["X-Kvpeer-Engine"])
                a.release_last.set()
                for task in held:
                    (await task).release()
        finally:
            await second.stop()
            await first.stop()
            for fake in (a, b):
                await fake.stop()
        return served

    assert asyncio.run(scenario(1.0)) == ["b", "b", "b"]
    assert asyncio.run(scenario(0.0))[0] == "a"
