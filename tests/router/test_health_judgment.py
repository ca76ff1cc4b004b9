"""Down is not restarted: health rule 3 with fake engines on real sockets.

One slow ``/health`` answer (a loaded API server) is a flap, told by the engine's start
time or, without one, by too few failed checks; a real restart (a new process on the same
port, a refused connection) is still judged restarted at its return; a hung engine
counts as restarted once enough checks failed, unless its start time proves it the same.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpeer.errors import ConfigError
from kvpeer.lab.engines.fakeengine import FakeEngine
from kvpeer.router.app import Router
from kvpeer.router.config import EngineEntry, RouterConfig, from_mapping
from kvpeer.router.feed import Continuity
from kvpeer.router.health import EngineHealth, Evidence, is_refused, judge
from kvpeer.router.server_socket import bind
from kvpeer.router.witness import MAX_METRICS_BYTES, StartTimeWitness, start_time
from tests.router.conftest import run

TIMEOUT_S = 0.3


# --- the rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(("witnessed", "refused", "failures", "expected"), [
    (Continuity.NEW, False, 0, Evidence.WITNESS_NEW),
    (Continuity.NEW, False, 9, Evidence.WITNESS_NEW),
    (Continuity.SAME, True, 9, Evidence.WITNESS_SAME),  # a proof outweighs the rest
    (Continuity.UNKNOWN, True, 1, Evidence.REFUSED),
    (Continuity.UNKNOWN, False, 3, Evidence.FAILURES),
    (Continuity.UNKNOWN, False, 2, Evidence.NONE),
    (Continuity.UNKNOWN, False, 1, Evidence.NONE),
])
def test_the_first_rule_that_applies_decides(
    witnessed: Continuity, refused: bool, failures: int, expected: Evidence,
) -> None:
    assert judge(witnessed, refused=refused, failures=failures,
                 restart_failures=3) is expected


def test_one_failure_is_a_restart_with_the_strict_setting() -> None:
    assert judge(Continuity.UNKNOWN, refused=False, failures=1,
                 restart_failures=1) is Evidence.FAILURES


# --- configuration ----------------------------------------------------------------------


def config(**keys: Any) -> RouterConfig:
    return from_mapping({"mode": "shared", **keys, "engine": [
        {"name": "a", "url": "http://127.0.0.1:8100", "peer": "127.0.0.1:5710"}]})


def test_the_default_and_the_named_errors() -> None:
    assert config().health_restart_failures == 3
    assert config(health_restart_failures="5").health_restart_failures == 5
    for bad in (0, 1001, -1, "x", True, 2.5):
        with pytest.raises(ConfigError, match="health_restart_failures"):
            config(health_restart_failures=bad)


def test_the_flag() -> None:
    import argparse

    from kvpeer.router.config import add_arguments, from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--mode", "shared", "--health-restart-failures", "1",
                              "--engine", "a=http://127.0.0.1:8100,peer=127.0.0.1:5710"])
    assert from_args(args).health_restart_failures == 1
    args = parser.parse_args(["--health-restart-failures", "zero",
                              "--engine", "a=http://127.0.0.1:8100,peer=127.0.0.1:5710"])
    with pytest.raises(ConfigError, match="health_restart_failures"):
        from_args(args)


# --- EngineHealth with the start-time witness, against fake engines -----------------------


class Harness:
    """One fake engine ``a`` checked by hand (no loop), with its verdicts recorded."""

    def __init__(self, session: aiohttp.ClientSession, engine: FakeEngine,
                 restart_failures: int) -> None:
        self.session = session
        self.engine = engine
        self.port = engine.port
        self.restarts: list[str] = []
        self.flaps: list[str] = []
        entries = [EngineEntry(spec) for spec in from_mapping({"mode": "shared", "engine": [
            {"name": "a", "url": engine.url, "peer": "127.0.0.1:5710"}]}).specs]
        witness = StartTimeWitness({"a": engine.url}, lambda: session)
        self.health = EngineHealth(entries, self.restarts.append, interval_s=60,
                                   timeout_s=TIMEOUT_S, restart_failures=restart_failures,
                                   witnesses={"start_time": witness},
                                   on_flap=self.flaps.append)

    async def check(self) -> bool:
        await self.health.check_once(self.session)
        return self.health.healthy("a")

    async def replace_engine(self, start_time: bool) -> None:
        """The engine's process ends and a new one listens on the same port."""
        old = self.engine
        await old.stop()
        self.engine = FakeEngine("a")
        self.engine.behaviour.start_time = start_time
        await self.engine.start(port=self.port)
        assert self.engine.started_at != old.started_at

    def verdicts(self) -> tuple[tuple[str, int], ...]:
        return self.health.statistics().verdicts


Scenario = Callable[[Harness], Awaitable[None]]


def scenario(body: Scenario, *, start_time: bool = True, restart_failures: int = 3) -> None:
    async def main() -> None:
        engine = FakeEngine("a")
        engine.behaviour.start_time = start_time
        await engine.start()
        async with aiohttp.ClientSession() as session:
            harness = Harness(session, engine, restart_failures)
            try:
                assert await harness.check()
                await body(harness)
            finally:
                await harness.engine.stop()

    run(main())


async def slow_once(h: Harness) -> None:
    h.engine.behaviour.health_delay_s = TIMEOUT_S * 3  # one answer after the timeout
    assert not await h.check()
    h.engine.behaviour.health_delay_s = 0.0
    assert await h.check()


def test_one_slow_answer_is_a_flap_proven_by_the_start_time() -> None:
    async def body(h: Harness) -> None:
        await slow_once(h)
        assert (h.restarts, h.flaps) == ([], ["a"])
        assert h.verdicts() == (("witness_same", 1),)
        stats = h.health.statistics()
        assert (stats.restarts, stats.flaps, stats.check_failures) == (0, 1, 1)

    scenario(body)


def test_one_slow_answer_without_a_start_time_is_a_flap_by_the_count() -> None:
    async def body(h: Harness) -> None:
        await slow_once(h)
        assert (h.restarts, h.flaps) == ([], ["a"])
        assert h.verdicts() == (("none", 1),)

    scenario(body, start_time=False)


def test_one_slow_answer_without_a_start_time_is_a_restart_when_strict() -> None:
    async def body(h: Harness) -> None:
        await slow_once(h)
        assert (h.restarts, h.flaps) == (["a"], [])
        assert h.verdicts() == (("failures", 1),)

    scenario(body, start_time=False, restart_failures=1)


def test_a_new_process_is_restarted_at_once_by_its_start_time() -> None:
    """Down one check (503, not refused), then another process answers on that port:
    its start time differs, so one failed check is enough."""
    async def body(h: Harness) -> None:
        h.engine.behaviour.health_status = 503
        assert not await h.check()
        await h.replace_engine(start_time=True)
        assert await h.check()
        assert (h.restarts, h.flaps) == (["a"], [])
        assert h.verdicts() == (("witness_new", 1),)
        # The new process's start time is the one known now: its next flap is one.
        await slow_once(h)
        assert h.flaps == ["a"]
        assert h.verdicts() == (("witness_new", 1), ("witness_same", 1))

    scenario(body)


def test_a_refused_connection_is_a_restart_at_once_without_a_start_time() -> None:
    async def body(h: Harness) -> None:
        await h.engine.stop()  # nothing listens: refused
        assert not await h.check()
        await h.replace_engine(start_time=False)
        assert await h.check()
        assert (h.restarts, h.flaps) == (["a"], [])
        assert h.verdicts() == (("refused", 1),)

    scenario(body, start_time=False)


def test_a_request_refused_while_up_counts_too() -> None:
    async def body(h: Harness) -> None:
        await h.engine.stop()
        with pytest.raises(aiohttp.ClientConnectorError) as caught:
            async with h.session.get(f"{h.engine.url}/health"):
                pass
        assert is_refused(caught.value)
        h.health.mark_down("a", str(caught.value), refused=True)
        assert not h.health.healthy("a")
        await h.replace_engine(start_time=False)
        assert await h.check()  # no failed check at all, but a refused connection
        assert h.verdicts() == (("refused", 1),)

    scenario(body, start_time=False)


@pytest.mark.parametrize(("start_time", "restarts", "verdicts"), [
    (False, ["a"], (("failures", 1),)),  # down too long, nothing proves it the same
    (True, [], (("witness_same", 1),)),  # its unchanged start time does
])
def test_a_hung_engine_is_restarted_after_enough_failures_unless_proven_the_same(
    start_time: bool, restarts: list[str], verdicts: tuple[tuple[str, int], ...],
) -> None:
    async def body(h: Harness) -> None:
        h.engine.behaviour.health_delay_s = 3600.0  # hung: every check times out
        for _ in range(3):
            assert not await h.check()
        assert h.health.statistics().check_failures == 3
        h.engine.behaviour.health_delay_s = 0.0
        assert await h.check()
        assert h.restarts == restarts
        assert h.verdicts() == verdicts

    scenario(body, start_time=start_time)


def test_failures_count_from_the_last_return() -> None:
    """Two separate one-check outages are two flaps, not a count of two."""
    async def body(h: Harness) -> None:
        await slow_once(h)
        await slow_once(h)
        assert h.verdicts() == (("none", 2),)

    scenario(body, start_time=False, restart_failures=2)


# --- the start time on /metrics: an engine's page is read with bounds ---------------------


async def serve_metrics(body: bytes) -> tuple[web.AppRunner, str]:
    async def page(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = bind("127.0.0.1", 0)
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(("page", "expected"), [
    (b"# HELP x\nprocess_start_time_seconds 1764000000.25\n", 1764000000.25),
    (b"process_start_time_seconds_x 5\nprocess_start_time_seconds 7e9\n", 7e9),
    (b"process_start_time_seconds nan\n", None),
    (b"process_start_time_seconds -3\n", None),
    (b"process_start_time_seconds 0x10\n", None),
    (b"process_start_time_seconds\n", None),
    (b"vllm:num_requests_running 0\n", None),
    (b"x 1\n" * (MAX_METRICS_BYTES // 4 + 1) + b"process_start_time_seconds 9\n", None),
])
def test_start_time_parses_only_a_sane_value(page: bytes, expected: float | None) -> None:
    async def main() -> float | None:
        runner, url = await serve_metrics(page)
        try:
            async with aiohttp.ClientSession() as session:
                return await start_time(session, url)
        finally:
            await runner.cleanup()

    assert run(main()) == expected


# --- the whole router: a slow /health keeps what the router learned -----------------------


def test_router_a_slow_health_answer_is_a_flap_and_a_restart_is_not() -> None:
    async def main() -> None:
        engine = FakeEngine("a")
        await engine.start()
        other = FakeEngine("b")
        await other.start()
        router = Router(from_mapping({
            "mode": "shared", "listen": "127.0.0.1:0", "health_interval_s": 0.05,
            "health_timeout_s": TIMEOUT_S,
            "engine": [{"name": "a", "url": engine.url, "peer": "127.0.0.1:5710"},
                       {"name": "b", "url": other.url, "peer": "127.0.0.2:5710"}]}))
        await router.start()

        def value(name: str, **labels: str) -> float:
            return float(router.registry.get_sample_value(name, labels) or 0.0)

        try:
            engine.behaviour.health_delay_s = TIMEOUT_S * 2
            await router.health.wait_for(lambda h: not h.healthy("a"), 10)
            engine.behaviour.health_delay_s = 0.0
            await router.health.wait_for(lambda h: h.healthy("a"), 10)
            assert value("kvpeer_router_engine_flaps_total") == 1.0
            assert value("kvpeer_router_engine_restarts_total") == 0.0
            assert value("kvpeer_router_engine_returns_total", evidence="witness_same") == 1.0

            port = other.port
            await other.stop()
            await router.health.wait_for(lambda h: not h.healthy("b"), 10)
            other = FakeEngine("b")
            await other.start(port=port)
            await router.health.wait_for(lambda h: h.healthy("b"), 10)
            assert value("kvpeer_router_engine_restarts_total") == 1.0
            assert value("kvpeer_router_engine_flaps_total") == 1.0
            restarted = (value("kvpeer_router_engine_returns_total", evidence="witness_new")
                         + value("kvpeer_router_engine_returns_total", evidence="refused"))
            assert restarted == 1.0
        finally:
            await router.stop()
            await engine.stop()
            await other.stop()

    run(main())
