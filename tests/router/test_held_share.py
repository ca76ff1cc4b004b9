"""Issue 37, the router's held blind spot: a source's tier answers peers from held blocks
only for the lookups its held copy covers, so a busy source's quote weights its serve
wait by the share it misses (router/heldshare.py, router/cost.py's docstring)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvpeer.router.cost import CostModel, CostPriors
from kvpeer.router.decide import RouterPolicy
from kvpeer.router.engineload import parse_peer_lookups
from kvpeer.router.heldshare import ALPHA, UNKNOWN, HeldShare
from kvpeer.router.index import MEDIUM_CPU, PrefixIndex
from kvpeer.router.policy import EngineLoad, EngineSpec, Mode
from tests.router.test_decide import PROMPT, busy, hold, idle, spec
from tests.router.test_engine_load import Clock, feed_for, scrape, serving

IDLE = EngineLoad(healthy=True, in_flight=0, queued_prompt_tokens=0)
BUSY = EngineLoad(healthy=True, in_flight=2, queued_prompt_tokens=1500)


def page(held: object, engine: object, labels: str = 'model_name="m"') -> str:
    return (
        "# TYPE vllm:kvpeer_peer_lookups_total counter\n"
        f'vllm:kvpeer_peer_lookups_total{{{labels},path="held"}} {held}\n'
        f'vllm:kvpeer_peer_lookups_total{{{labels},path="engine"}} {engine}\n'
        f'vllm:kvpeer_peer_lookups_created{{{labels},path="held"}} 1.7e9\n'
        "vllm:num_requests_running 1\n"
    )


class TestParse:
    def test_both_paths_are_read_per_engine_label(self) -> None:
        text = page(7, 3, 'engine="0"') + page(1, 0, 'engine="1"')
        assert parse_peer_lookups(text) == {"0": (7.0, 3.0), "1": (1.0, 0.0)}
        assert parse_peer_lookups(page(4, 4)) == {"": (4.0, 4.0)}

    @pytest.mark.parametrize(
        "value", ["nan", "NaN", "inf", "-Inf", "-1", "1e300", "9.1e15", "four", ""]
    )
    def test_a_hostile_count_drops_that_engines_pair(self, value: str) -> None:
        assert parse_peer_lookups(page(value, 3)) == {}
        assert parse_peer_lookups(page(3, value)) == {}

    def test_other_paths_and_series_are_not_lookups(self) -> None:
        text = ('vllm:kvpeer_peer_lookups_total{path="other"} 5\n'
                'vllm:kvpeer_lookups_total{result="hit",path="held"} 5\n'
                'vllm:kvpeer_peer_lookups_total{path="held"} 5\n')  # fmt: skip
        assert parse_peer_lookups(text) == {}  # no "engine" series: not a pair


class TestShare:
    def test_unknown_until_lookups_are_reported_then_counts_weigh_per_lookup(self) -> None:
        share = HeldShare()
        assert share.share("a") == UNKNOWN == 1.0
        share.observe("a", 0, 0)
        assert share.share("a") == 1.0
        share.observe("a", 0, 1)  # one lookup, for the engine
        assert share.share("a") == pytest.approx(1.0 - ALPHA)
        share.observe("a", 0, 1)  # an idle source keeps its share
        assert share.share("a") == pytest.approx(1.0 - ALPHA)
        share.observe("a", 30, 1)  # 30 held: the share follows them
        assert share.share("a") > 0.95
        share.observe("a", 30, 1_000_001)
        assert share.share("a") == pytest.approx(0.0, abs=1e-9)
        assert share.statistics()["lookups:a"] == 1_000_001 + 30

    def test_a_router_started_late_learns_the_history_at_once(self) -> None:
        share = HeldShare()
        share.observe("a", 250, 750)
        assert share.share("a") == pytest.approx(0.25, abs=1e-6)

    def test_a_counter_reset_counts_from_zero_again(self) -> None:
        share = HeldShare()
        share.observe("a", 1000, 0)
        assert share.share("a") == pytest.approx(1.0)
        share.observe("a", 0, 40)  # the engine restarted: 40 new lookups, none held
        assert share.share("a") < 0.01
        share.observe("a", 40, 40)  # and from that baseline on
        assert share.share("a") > 0.99

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 1e300])
    def test_hostile_counts_are_ignored(self, bad: float) -> None:
        share = HeldShare()
        share.observe("a", 10, 10)
        before = share.share("a")
        share.observe("a", bad, 20)
        share.observe("a", 20, bad)
        assert share.share("a") == before
        share.observe("a", 10, 30)  # the baseline was kept: 20 new, none held
        assert share.share("a") < before

    def test_the_load_scrape_feeds_it(self) -> None:
        async def scenario() -> tuple[float, float]:
            clock = Clock()
            async with serving(page(3, 1)) as url:
                feed = feed_for(url, {"e": (0, 0)}, clock)
                await scrape(feed)
                first = feed.held_share.share("e")
            async with serving(page("NaN", 9)) as url:  # hostile: nothing changes
                feed2 = feed_for(url, {"e": (0, 0)}, clock)
                await scrape(feed2)
                assert feed2.held_share.share("e") == UNKNOWN
                assert feed2.report("e") is not None  # the load is still read
            return first, feed.held_share.statistics()["lookups:e"]

        first, lookups = asyncio.run(scenario())
        assert first == pytest.approx(1.0 - (1.0 - (1.0 - ALPHA) ** 4) * 0.25)
        assert lookups == 4.0

    def test_data_parallel_ranks_read_their_label(self) -> None:
        async def scenario() -> tuple[float, float]:
            text = page(0, 8, 'engine="0"') + page(8, 0, 'engine="1"')
            async with serving(text) as url:
                feed = feed_for(url, {"e-dp0": (0, 0), "e-dp1": (0, 0)}, Clock(), dp_ranks=2)
                await scrape(feed)
                return feed.held_share.share("e-dp0"), feed.held_share.share("e-dp1")

        rank0, rank1 = asyncio.run(scenario())
        assert rank0 < 0.4
        assert rank1 == 1.0


class TestQuote:
    def test_held_one_is_todays_held_quote_and_zero_a_sources_without(self) -> None:
        cost = CostModel()
        line = cost.pull_quote_s("s", 1000, IDLE)
        assert cost.pull_quote_s("s", 1000, BUSY, held=1.0) == line
        assert cost.pull_quote_s("s", 1000, BUSY, held=True) == line
        without = cost.pull_quote_s("s", 1000, BUSY)
        assert cost.pull_quote_s("s", 1000, BUSY, held=0.0) == without
        busy_terms = cost.busy_s("s") + cost.serve_wait_s("s", BUSY)
        assert without[0] - line[0] == pytest.approx(busy_terms)
        assert busy_terms > 0.2

    @pytest.mark.parametrize("held", [0.1, 0.25, 0.5, 0.9])
    def test_in_between_adds_the_busy_terms_times_the_share_missed(self, held: float) -> None:
        cost = CostModel()
        line = cost.pull_quote_s("s", 1000, IDLE)[0]
        without = cost.pull_quote_s("s", 1000, BUSY)[0]
        quote = cost.pull_quote_s("s", 1000, BUSY, held=held)[0]
        assert line < quote < without
        assert quote == pytest.approx(line + (1 - held) * (without - line))
        assert cost.pull_s("c", "s", 1000, BUSY, held=held) == pytest.approx(
            quote + cost.rates()["cold_session_s"])  # no session warm yet

    @pytest.mark.parametrize("held", [0.0, 0.4, 0.9])
    def test_a_kvpeer_sources_misses_cost_at_most_its_engine_wait_and_the_compute(
        self, held: float
    ) -> None:
        """A kvpeer tier answers what its held blocks miss within ``engine_wait_s`` of
        its engine's step, and the consumer computes (kvpeer.node.enginewait): however
        long its busy steps were learned to be, a miss is quoted at most that."""
        cost = CostModel()
        for _ in range(10):  # it was seen waiting 4 s for its engine (issue 37)
            cost.observe_pull("c", "s", 800, BUSY, 4.0, held=0.5)
        line = cost.pull_quote_s("s", 1000, IDLE)[0]
        unbounded = cost.pull_quote_s("s", 1000, BUSY, held=held)[0]
        bounded = cost.pull_quote_s("s", 1000, BUSY, held=held, bounded=True)[0]
        compute = cost.compute_s("s", 1000, IDLE)
        assert unbounded == pytest.approx(
            line + (1 - held) * (cost.busy_s("s") + cost.serve_wait_s("s", BUSY)))
        assert bounded == pytest.approx(
            line + (1 - held) * (cost.priors.engine_wait_s + compute))
        assert bounded < unbounded
        # a short wait is not raised to the bound
        fresh = CostModel()
        assert fresh.pull_quote_s("s", 1000, BUSY, held=held, bounded=True) == (
            fresh.pull_quote_s("s", 1000, BUSY, held=held))

    @pytest.mark.parametrize(("held", "clamped"), [(float("nan"), 0.0), (-3.0, 0.0), (7.0, 1.0)])
    def test_a_share_out_of_range_is_clamped(self, held: float, clamped: float) -> None:
        cost = CostModel()  # NaN: nothing held
        quote = cost.pull_quote_s("s", 1000, BUSY, held=held)
        assert quote == cost.pull_quote_s("s", 1000, BUSY, held=clamped)

    def test_an_idle_or_parked_source_is_its_line_whatever_it_holds(self) -> None:
        cost = CostModel()
        line = cost.pull_quote_s("s", 500, IDLE)
        for held in (0.0, 0.5, 1.0):
            assert cost.pull_quote_s("s", 500, IDLE, held=held) == line
            assert cost.pull_quote_s("s", 500, BUSY, parked=True, held=held) == line

    def test_the_decision_reads_the_share_its_load_carries(self) -> None:
        """A held source that misses its held copy half the time is predicted halfway
        between one that never misses and one without held blocks."""
        def predicted(held: bool, share: float) -> float:
            specs = [spec("e0"),
                     EngineSpec("e1", "http://e1", "10.0.0.2", 5710, serves_held=held)]
            index = PrefixIndex()
            policy = RouterPolicy(specs, Mode.SHARED, index)
            hold(index, "e1", 1024, MEDIUM_CPU)
            source = dataclasses.replace(busy(queued=2000, in_flight=2), held_share=share)
            plan = policy.plan("r", PROMPT, {"e0": idle(), "e1": source}, 0.0,
                               serve_on="e0", pull_from="e1")
            assert plan.source == "e1"
            assert plan.predicted_ttft_s is not None
            return plan.predicted_ttft_s

        all_held, half, without = predicted(True, 1.0), predicted(True, 0.5), predicted(False, 1.0)
        assert all_held < half < without
        assert half == pytest.approx((all_held + without) / 2)
        assert predicted(False, 0.3) == without  # no held blocks: the share is not read
        assert predicted(True, 0.0) == pytest.approx(without)


    @pytest.mark.parametrize(("engine_wait_s", "pulls"), [(0.25, True), (100.0, False)])
    def test_a_source_seen_slow_when_busy_is_still_pulled_from_when_misses_are_bounded(
        self, engine_wait_s: float, pulls: bool
    ) -> None:
        """Issue 37's ladder: a held source whose misses had waited seconds for its engine
        made the router compute a prompt it held 80 % of the time. With the tier's bound
        on that wait (0.25 s, then the consumer computes), the pull wins; with a bound as
        long as the learned wait, computing does, as before."""
        specs = [spec("e0"), EngineSpec("e1", "http://e1", "10.0.0.2", 5710, serves_held=True)]
        index = PrefixIndex()
        cost = CostModel(CostPriors(engine_wait_s=engine_wait_s))
        policy = RouterPolicy(specs, Mode.SHARED, index, cost=cost)
        hold(index, "e1", 1024, MEDIUM_CPU)
        for _ in range(10):  # e1's misses waited 4 s for its engine
            cost.observe_pull("e0", "e1", 800, BUSY, 4.0, held=0.5)
        source = dataclasses.replace(busy(queued=2000, in_flight=2), held_share=0.8)
        plan = policy.plan("r", PROMPT, {"e0": idle(), "e1": source}, 0.0, serve_on="e0")
        assert plan.engine == "e0"
        assert (plan.source == "e1") is pulls


class TestLearning:
    def test_a_pull_that_waited_teaches_the_busy_cost_and_a_held_one_the_line(self) -> None:
        cost = CostModel()
        cost.observe_pull("c", "s", 100, IDLE, cost.pull_s("c", "s", 100, IDLE))  # warm
        wait = cost.serve_wait_s("s", BUSY)
        rates = dict(cost.rates())
        for _ in range(10):  # waited for the engine: 4 s (issue 37 measured 4.3 s)
            cost.observe_pull("c", "s", 800, BUSY, 4.0, held=0.5)
        assert "pull_base_s:s" not in cost.rates()  # the line learned nothing
        assert cost.busy_s("s") > 2.0
        assert cost.rates()["pull_base_s:*"] == rates["pull_base_s:*"]
        busy_before = cost.busy_s("s")
        line = cost.pull_quote_s("s", 800, IDLE)[0]
        for _ in range(10):  # answered from held blocks: the line's time
            cost.observe_pull("c", "s", 800, BUSY, line + 0.4 * wait, held=0.5)
        assert cost.busy_s("s") == busy_before
        assert cost.rates()["pull_base_s:*"] != rates["pull_base_s:*"]

    def test_with_a_share_of_one_or_zero_learning_is_as_before(self) -> None:
        """Share 1 teaches every warm busy pull to the line (the held path before issue
        37); share 0 teaches it to the busy cost, however fast it was."""
        for held, teaches_line in ((1.0, True), (0.0, False)):
            cost = CostModel()
            cost.observe_pull("c", "s", 100, IDLE, cost.pull_s("c", "s", 100, IDLE))
            for _ in range(10):
                cost.observe_pull("c", "s", 800, BUSY, 4.0, held=held)
            assert ("source_busy_own_s:s" not in cost.rates()) is teaches_line
            cost2 = CostModel()
            cost2.observe_pull("c", "s", 100, IDLE, cost2.pull_s("c", "s", 100, IDLE))
            for _ in range(10):
                cost2.observe_pull("c", "s", 800, BUSY, 0.001, held=held)
            assert ("source_busy_own_s:s" not in cost2.rates()) is teaches_line

    def test_a_first_pull_that_waited_leaves_the_busy_terms_out_of_the_cold_penalty(
        self,
    ) -> None:
        waited, held = CostModel(), CostModel()
        extra = waited.busy_s("s") + waited.serve_wait_s("s", BUSY)
        cold = waited.pull_quote_s("s", 800, IDLE)[1]  # the line and the cold penalty
        assert 0.5 * waited.serve_wait_s("s", BUSY) > 0.1
        waited.observe_pull("c", "s", 800, BUSY, cold + extra + 0.1, held=0.5)
        held.observe_pull("c", "s", 800, BUSY, cold + 0.1, held=0.5)
        learned = held.rates()["cold_session_s"]
        assert learned > held.priors.cold_session_s
        assert waited.rates()["cold_session_s"] == pytest.approx(learned)
