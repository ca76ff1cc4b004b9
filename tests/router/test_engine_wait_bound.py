"""Each source's bound on a peer's wait for its busy engine, learned from the engine: a
kvpeer tier reports its ``engine_wait_s`` on ``/metrics`` (``vllm:kvpeer_engine_wait_seconds``,
``+Inf`` for null), the router reads it with the load (kvpeer.router.engineload rule 6) and
quotes that source's misses by it (kvpeer.router.cost); a value no tier can have is not a
report, and the prior (the tier's default) stands."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Mapping

import pytest

from kvpeer.lab.engines.fakeengine import Behaviour, FakeEngine
from kvpeer.router.app import Router
from kvpeer.router.config import from_mapping
from kvpeer.router.cost import CostModel
from kvpeer.router.decide import RouterPolicy
from kvpeer.router.engineload import parse_engine_wait
from kvpeer.router.index import MEDIUM_CPU, PrefixIndex
from kvpeer.router.metrics import PREFIX
from kvpeer.router.policy import MAX_ENGINE_WAIT_S, EngineLoad, EngineSpec, Mode, Plan
from tests.router.conftest import engine_table, fleet
from tests.router.test_decide import PROMPT, busy, hold, idle, spec
from tests.router.test_engine_load import Clock, feed_for, scrape, serving

IDLE = EngineLoad(healthy=True, in_flight=0, queued_prompt_tokens=0)
BUSY = EngineLoad(healthy=True, in_flight=2, queued_prompt_tokens=1500)
#: Values no tier's engine_wait_s can be: NaN, negative, past the config's limit, not a number
HOSTILE = ["nan", "NaN", "-Inf", "-inf", "-1", "-0.001", "1.0000001e9", "1e300", "four",
           "0x10", ""]  # fmt: skip


def page(value: object, labels: str = 'engine="0",model_name="m"') -> str:
    return ("# TYPE vllm:kvpeer_engine_wait_seconds gauge\n"
            f"vllm:kvpeer_engine_wait_seconds{{{labels}}} {value}\n"
            "vllm:num_requests_running 1\n")  # fmt: skip


def test_the_limit_is_the_tiers_config_limit() -> None:
    from kvpeer.config import MAX_SECONDS

    assert MAX_ENGINE_WAIT_S == MAX_SECONDS


class TestParse:
    def test_the_bound_is_read_per_engine_label(self) -> None:
        text = page(0.25, 'engine="0"') + page("+Inf", 'engine="1"') + page(0, 'engine="2"')
        assert parse_engine_wait(text) == {"0": 0.25, "1": math.inf, "2": 0.0}
        assert parse_engine_wait(page(1.5, 'model_name="m"')) == {"": 1.5}
        assert parse_engine_wait("vllm:kvpeer_engine_wait_seconds 1e9\n") == {"": 1e9}
        for inf in ("Inf", "inf", "+inf"):
            assert parse_engine_wait(page(inf)) == {"0": math.inf}

    def test_no_series_is_no_report(self) -> None:
        assert parse_engine_wait("vllm:num_requests_running 1\n") == {}
        text = ('vllm:kvpeer_engine_wait_seconds_total{engine="0"} 5\n'
                'vllm:kvpeer_engine_wait_secondsx{engine="0"} 5\n'
                'kvpeer_engine_wait_seconds{engine="0"} 5\n'
                '# vllm:kvpeer_engine_wait_seconds{engine="0"} 5\n')  # fmt: skip
        assert parse_engine_wait(text) == {}

    @pytest.mark.parametrize("value", HOSTILE)
    def test_a_hostile_value_is_no_report(self, value: str) -> None:
        assert parse_engine_wait(page(value)) == {}
        good = page(0.5, 'engine="1"')
        assert parse_engine_wait(page(value) + good) == {"1": 0.5}

    def test_several_lines_of_one_label_give_the_longest_bound(self) -> None:
        text = page(0.5, 'engine="0",model_name="a"') + page(2, 'engine="0",model_name="b"')
        assert parse_engine_wait(text) == {"0": 2.0}


class TestFeed:
    def test_a_scrape_keeps_each_engines_bound_until_its_page_says_otherwise(self) -> None:
        async def scenario() -> list[float | None]:
            engine = FakeEngine("e", Behaviour(engine_wait="0.5"))
            await engine.start()
            feed = feed_for(engine.url, {"e": (0, 0)}, Clock())
            said: list[float | None] = [feed.engine_wait_s("e")]  # before any scrape
            try:
                for wait in ("0.5", "+Inf", None, "0.25"):  # +Inf: a tier restarted with null
                    engine.behaviour.engine_wait = wait  # None: no kvpeer tier now
                    await scrape(feed)
                    said.append(feed.engine_wait_s("e"))
                assert feed.report("e") is not None  # the load is read with it
            finally:
                await engine.stop()
            await scrape(feed)  # refused: a failed scrape keeps what the engine last said
            said.append(feed.engine_wait_s("e"))
            assert feed.statistics()["scrape_failures_total"] == 1.0
            return said

        assert asyncio.run(scenario()) == [None, 0.5, math.inf, None, 0.25, 0.25]

    @pytest.mark.parametrize("value", ["NaN", "-1", "2e9", "-Inf"])
    def test_a_hostile_engine_is_not_reported_and_its_load_still_is(self, value: str) -> None:
        async def scenario() -> None:
            async with serving(page(value)) as url:
                feed = feed_for(url, {"e": (0, 0)}, Clock())
                await scrape(feed)
            assert feed.engine_wait_s("e") is None
            assert feed.report("e") is not None
            assert feed.statistics()["scrape_failures_total"] == 0.0

        asyncio.run(scenario())

    def test_data_parallel_ranks_read_their_label(self) -> None:
        async def scenario() -> tuple[float | None, float | None]:
            async with serving(page(0.1, 'engine="0"') + page(3, 'engine="1"')) as url:
                feed = feed_for(url, {"e-dp0": (0, 0), "e-dp1": (0, 0)}, Clock(), dp_ranks=2)
                await scrape(feed)
                return feed.engine_wait_s("e-dp0"), feed.engine_wait_s("e-dp1")

        assert asyncio.run(scenario()) == (0.1, 3.0)


class TestBound:
    def test_a_report_replaces_the_prior_and_inf_is_no_bound(self) -> None:
        cost = CostModel()
        prior = cost.priors.engine_wait_s
        assert cost.engine_wait_bound(None, bounded=True) == prior == 0.25
        assert cost.engine_wait_bound(None, bounded=False) is None
        assert cost.engine_wait_bound(1.5, bounded=True) == 1.5
        assert cost.engine_wait_bound(0.0, bounded=True) == 0.0
        # a tier that reports a bound is a kvpeer tier, named held or not
        assert cost.engine_wait_bound(1.5, bounded=False) == 1.5
        assert cost.engine_wait_bound(math.inf, bounded=True) is None

    @pytest.mark.parametrize("bad", [math.nan, -1.0, -math.inf, 2e9, MAX_ENGINE_WAIT_S * 1.01])
    def test_a_value_no_tier_can_have_is_no_report(self, bad: float) -> None:
        """The edge already drops these; the cost model does not trust a load's either."""
        cost = CostModel()
        assert cost.engine_wait_bound(bad, bounded=True) == cost.priors.engine_wait_s
        assert cost.engine_wait_bound(bad, bounded=False) is None
        slow = seen_waiting(cost)
        load = dataclasses.replace(BUSY, engine_wait_s=bad)
        assert slow.pull_quote_s("s", 1000, load, held=0.5, bounded=True) == (
            slow.pull_quote_s("s", 1000, BUSY, held=0.5, bounded=True))


def seen_waiting(cost: CostModel, source: str = "s", consumer: str = "c") -> CostModel:
    """``cost`` after ten warm pulls from busy ``source`` that waited 4 s for its engine."""
    for _ in range(10):
        cost.observe_pull(consumer, source, 800, BUSY, 4.0, held=0.5)
    return cost


class TestQuote:
    @pytest.mark.parametrize("held", [0.0, 0.5])
    @pytest.mark.parametrize("reported", [0.0, 0.1, 1.0])
    def test_a_source_is_quoted_by_the_bound_it_reports(
        self, held: float, reported: float
    ) -> None:
        cost = seen_waiting(CostModel())
        line = cost.pull_quote_s("s", 1000, IDLE)[0]
        compute = cost.compute_s("s", 1000, IDLE)
        load = dataclasses.replace(BUSY, engine_wait_s=reported)
        for bounded in (True, False):
            quote = cost.pull_quote_s("s", 1000, load, held=held, bounded=bounded)[0]
            assert quote == pytest.approx(line + (1 - held) * (reported + compute))

    def test_inf_is_the_unbounded_quote_and_no_report_the_priors(self) -> None:
        cost = seen_waiting(CostModel())
        unbounded = cost.pull_quote_s("s", 1000, BUSY, held=0.5)
        prior = cost.pull_quote_s("s", 1000, BUSY, held=0.5, bounded=True)
        assert prior < unbounded
        never = dataclasses.replace(BUSY, engine_wait_s=math.inf)
        assert cost.pull_quote_s("s", 1000, never, held=0.5, bounded=True) == unbounded
        assert cost.pull_quote_s("s", 1000, BUSY, held=0.5, bounded=True) == prior
        long = dataclasses.replace(BUSY, engine_wait_s=100.0)  # longer than any wait seen
        assert cost.pull_quote_s("s", 1000, long, held=0.5, bounded=True) == unbounded


def policy_with(*specs: EngineSpec) -> tuple[RouterPolicy, PrefixIndex, CostModel]:
    index, cost = PrefixIndex(), CostModel()
    return RouterPolicy(list(specs), Mode.SHARED, index, cost=cost), index, cost


class TestDecision:
    @pytest.mark.parametrize(
        ("reported", "pulls"),
        [(None, True), (0.25, True), (0.0, True), (100.0, False), (math.inf, False)],
    )
    def test_a_held_source_seen_slow_is_pulled_from_only_when_its_bound_is_short(
        self, reported: float | None, pulls: bool
    ) -> None:
        """test_held_share's ladder case, with the bound from the source's engine instead
        of the router's prior: 0.25 s (or none reported: the prior) pulls, a tier whose
        bound outlasts the wait it was seen to take (or that has none) is computed."""
        held = EngineSpec("e1", "http://e1", "10.0.0.2", 5710, serves_held=True)
        policy, index, cost = policy_with(spec("e0"), held)
        hold(index, "e1", 1024, MEDIUM_CPU)
        seen_waiting(cost, "e1", "e0")
        source = dataclasses.replace(busy(queued=2000, in_flight=2), held_share=0.8,
                                     engine_wait_s=reported)  # fmt: skip
        plan = policy.plan("r", PROMPT, {"e0": idle(), "e1": source}, 0.0, serve_on="e0")
        assert plan.engine == "e0"
        assert (plan.source == "e1") is pulls

    @pytest.mark.parametrize("short", ["e1", "e2"])
    def test_of_two_holders_seen_alike_the_one_with_the_short_bound_is_pulled_from(
        self, short: str
    ) -> None:
        """Two busy holders of the prompt, each seen waiting 4 s for its engine: the one
        whose tier reports 0.1 s is pulled from; the other reports 30 s, as long a bound
        as computing would take (the same pair with both at 30 s computes)."""
        specs = [EngineSpec(n, f"http://{n}", f"10.0.0.{i}", 5710, serves_held=True)
                 for i, n in ((2, "e1"), (3, "e2"))]  # fmt: skip
        policy, index, cost = policy_with(spec("e0"), *specs)
        loads: dict[str, EngineLoad] = {"e0": idle()}
        for name in ("e1", "e2"):
            hold(index, name, 1024, MEDIUM_CPU, salt=int(name[1]))
            seen_waiting(cost, name, "e0")
            loads[name] = dataclasses.replace(
                busy(queued=2000, in_flight=2), held_share=0.8,
                engine_wait_s=0.1 if name == short else 30.0)
        plan = policy.plan("r", PROMPT, loads, 0.0, serve_on="e0")
        assert (plan.engine, plan.source) == ("e0", short)
        long = {n: dataclasses.replace(load, engine_wait_s=30.0) for n, load in loads.items()}
        assert policy.plan("r2", PROMPT, long, 0.0, serve_on="e0").source is None

    def test_a_source_not_named_held_is_quoted_by_the_bound_it_reports(self) -> None:
        """Its engine says it is a kvpeer tier with a bound: its misses (all its lookups,
        as far as the router knows) cost at most that bound and the compute."""
        def predicted(reported: float | None) -> float:
            policy, index, cost = policy_with(spec("e0"), spec("e1"))  # fresh: no pull booked
            hold(index, "e1", 1024, MEDIUM_CPU)
            seen_waiting(cost, "e1", "e0")
            source = dataclasses.replace(busy(queued=2000, in_flight=2), engine_wait_s=reported)
            plan = policy.plan("r", PROMPT, {"e0": idle(), "e1": source}, 0.0,
                               serve_on="e0", pull_from="e1")  # fmt: skip
            assert plan.source == "e1"
            assert plan.predicted_ttft_s is not None
            return plan.predicted_ttft_s

        unreported, never, short = predicted(None), predicted(math.inf), predicted(0.25)
        assert never == unreported  # not held, no report: unbounded, as before
        assert short < unreported - 1.0


# -- through the router: its scrape, the loads its policy is given, its metric --------------

WAITS = {"a": ("1.5", True), "b": (None, True), "c": ("+Inf", True), "d": ("NaN", True),
         "e": (None, False), "f": ("0.5", False)}  # fmt: skip
#: what each engine's load carries, and what the router quotes it by (its metric)
CARRIED = {"a": 1.5, "b": None, "c": math.inf, "d": None, "e": None, "f": 0.5}
QUOTED = {"a": 1.5, "b": 0.25, "c": math.inf, "d": 0.25, "e": math.inf, "f": 0.5}


def fakes() -> dict[str, FakeEngine]:
    return {name: FakeEngine(name, Behaviour(engine_wait=wait))
            for name, (wait, _held) in WAITS.items()}  # fmt: skip


def test_the_policy_is_given_each_engines_reported_bound() -> None:
    seen: dict[str, EngineLoad] = {}

    def choose(loads: Mapping[str, EngineLoad]) -> Plan:
        seen.update(loads)
        return Plan(engine="a")

    async def scenario() -> None:
        engines = fakes()
        for fake in engines.values():
            await fake.start()
        roles = dict.fromkeys(engines, "both")
        async with fleet(roles=roles, choose=choose, engines=engines,
                         settings={"load_scrape_interval_s": 30}) as f:  # fmt: skip
            assert f.router.engine_load is not None
            await f.router.engine_load.scrape_once(f.router.session)
            status, _ = await f.post("/v1/completions",
                                     {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
            assert status == 200

    asyncio.run(scenario())
    assert {name: load.engine_wait_s for name, load in seen.items()} == CARRIED


def test_the_router_exports_the_bound_it_quotes_each_source_by() -> None:
    async def scenario() -> dict[str, float]:
        engines = fakes()
        for fake in engines.values():
            await fake.start()
        tables = [{**engine_table(name, fake, i), "held": WAITS[name][1]}
                  for i, (name, fake) in enumerate(engines.items())]  # fmt: skip
        router = Router(from_mapping({"mode": "shared", "listen": "127.0.0.1:0",
                                      "health_interval_s": 30, "load_scrape_interval_s": 30,
                                      "engine": tables}))  # fmt: skip
        await router.start()
        try:
            assert router.engine_load is not None
            await router.engine_load.scrape_once(router.session)
            return {sample.labels["source"]: sample.value
                    for family in router.registry.collect()
                    if family.name == PREFIX + "source_engine_wait_seconds"
                    for sample in family.samples}  # fmt: skip
        finally:
            await router.stop()
            for fake in engines.values():
                await fake.stop()

    assert asyncio.run(scenario()) == QUOTED
