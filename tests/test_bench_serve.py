"""``kvpeer bench serve`` without engines: parsing and validation, the workload
generators, the statistics, the arm x workload matrix (fake engines behind the real
router, real HTTP), the table, ``--json`` and the plot file.

One real arm pair (``none``, ``kvpeer`` on ``chat``, ``--quick``) runs in
``tests/vllm/test_bench_serve_real.py``; the runs whose numbers docs/benchmarks.md keeps
are run by hand: each costs many minutes on this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy
import pytest

from kvpeer.cli import build_parser, main
from kvpeer.errors import ConfigError
from kvpeer.lab.bench.serve_bench import (
    ARM_POLICIES,
    ARMS,
    QUICK_SHAPE,
    ArmFleet,
    ArmUnavailable,
    ServeBenchSpec,
    run_matrix,
)
from kvpeer.lab.bench.serve_client import run_phase
from kvpeer.lab.bench.serve_plot import plot
from kvpeer.lab.bench.serve_stats import (
    Cell,
    FleetCounters,
    PeerCounters,
    RequestRecord,
    median_ratios,
    percentile,
    pool,
    ratios,
    render,
    summarize,
)
from kvpeer.lab.bench.serve_vllm import router_plans
from kvpeer.lab.bench.serve_workloads import (
    MAX_CONTEXT,
    PINNED,
    UNPINNED,
    WORKLOADS,
    BenchRequest,
    Shape,
    build,
)
from kvpeer.lab.engines.fakeengine import Behaviour, FakeEngine
from kvpeer.router.background import BackgroundRouter
from kvpeer.router.config import EngineEntry, RouterConfig
from kvpeer.router.policy import EngineSpec, Mode, Role

TINY = replace(QUICK_SHAPE, requests=4, rate=50.0, prompt_tokens=96, suffix_tokens=32,
               output_tokens=3, background_tokens=128, think_s=0.0)  # fmt: skip
CACHED_BY_ARM = {"none": 0, "affinity": 16, "load": 8, "kvpeer": 64, "kvpeer-affinity": 24,
                 "vllm-p2p": 32}
PINNED_ARMS = ("none", "kvpeer", "vllm-p2p")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The serving model's word-level tokenizer, loaded the way vLLM loads it."""
    from vllm.tokenizers import get_tokenizer

    from kvpeer.lab.engines.model import write_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, 512)
    return get_tokenizer(str(directory))


def spec_from(*argv: str) -> ServeBenchSpec:
    args = build_parser().parse_args(["bench", "serve", *argv])
    return ServeBenchSpec.from_args(args)


# --- parsing and validation -------------------------------------------------------------


def test_defaults_are_every_arm_and_the_unpinned_workloads() -> None:
    spec = spec_from()
    assert spec.arms == ARMS == ("none", "affinity", "load", "kvpeer", "kvpeer-affinity",
                                 "vllm-p2p")
    assert spec.workloads == UNPINNED == ("prefix", "chat", "chat-skewed")
    assert WORKLOADS == UNPINNED + PINNED
    assert PINNED == ("pinned-chat", "system-prompt", "pd", "busy-producer")
    assert spec.data_plane == "shm"
    assert spec.loads is None  # probed
    assert spec_from("--loads", "0.3,0.8").loads == (0.3, 0.8)


def test_flags_choose_arms_workloads_and_sizes() -> None:
    spec = spec_from("--quick", "--arms", "kvpeer, none", "--workloads", "chat,pd",
                     "--requests", "9", "--rate", "0.5", "--seed", "7")  # fmt: skip
    assert spec.arms == ("kvpeer", "none")
    assert spec.workloads == ("chat", "pd")
    assert spec.shape == replace(QUICK_SHAPE, requests=9, rate=0.5)
    assert spec.seed == 7
    assert spec.repeats == 1
    assert spec_from("--repeat", "3").repeats == 3


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("--arms", "kvpeer,vllm"), "'vllm'"),
        (("--arms", ","), "--arms"),
        (("--arms", "none,none"), "'none' given twice"),
        (("--workloads", "chats"), "'chats'"),
        (("--requests", "0"), "--requests 0"),
        (("--rate", "0"), "--rate 0.0"),
        (("--rate", "nan"), "--rate nan"),
        (("--rate", "-1"), "--rate -1.0"),
        (("--data-plane", "rdma"), "'rdma'"),
        (("--max-num-batched-tokens", "16"), "--max-num-batched-tokens 16"),
        (("--max-num-batched-tokens", "100000"), "--max-num-batched-tokens 100000"),
        (("--repeat", "0"), "--repeat 0"),
        (("--repeat", "21"), "--repeat 21"),
        (("--loads", "0.8,0.3"), "--loads 0.8,0.3"),
        (("--loads", "0,0.3"), "--loads 0,0.3"),
        (("--loads", "0.3,inf"), "--loads 0.3,inf"),
        (("--arms", "none", "--workloads", "chat"), "nothing to run"),
        (("--arms", "affinity", "--workloads", "pd"), "nothing to run"),
    ],
)
def test_bad_values_are_named(argv: tuple[str, ...], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        spec_from(*argv)


def test_the_step_budget_goes_to_every_engine_of_every_arm_alike() -> None:
    assert spec_from().engine_args() == ()
    spec = spec_from("--max-num-batched-tokens", "512")
    assert spec.step_tokens == 512
    assert spec.engine_args() == ("--max-num-batched-tokens", "512")


def test_the_command_reports_a_bad_value_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "serve", "--arms", "kvpeer,bogus"]) == 2
    assert "'bogus'" in capsys.readouterr().err


def test_prompts_that_cannot_fit_the_context_are_refused() -> None:
    with pytest.raises(ConfigError, match="prompt tokens 1900"):
        ServeBenchSpec(shape=replace(QUICK_SHAPE, prompt_tokens=1900))
    with pytest.raises(ConfigError, match="chat turns 1"):
        ServeBenchSpec(shape=replace(QUICK_SHAPE, turns=1))


# --- workloads ----------------------------------------------------------------------------


def test_loads_that_are_not_two_numbers_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        spec_from("--loads", "0.3")
    assert "expected LOW,HIGH" in capsys.readouterr().err


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_seeded(name: str, tokenizer: Any) -> None:
    def made(seed: int, variant: str = "") -> object:
        return build(name, QUICK_SHAPE, seed, variant=variant, tokenizer=tokenizer)

    assert made(1) == made(1)
    assert made(1) != made(2)
    assert made(1, "low") != made(1, "high")  # two loads on one fleet share no prompt


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_have_the_requested_size_and_fit(name: str, tokenizer: Any) -> None:
    workload = build(name, QUICK_SHAPE, 0, tokenizer=tokenizer)
    assert workload.pinned == (name in PINNED)
    if name == "prefix":  # vLLM's dataset: requests // prefixes per prefix
        assert len(workload.measured) == QUICK_SHAPE.requests // QUICK_SHAPE.prefixes * (
            QUICK_SHAPE.prefixes)
    else:
        assert len(workload.measured) == QUICK_SHAPE.requests
    times = [r.at_s for r in workload.main]
    assert times == sorted(times)
    assert times[0] == 0.0
    for request in (*workload.setup, *workload.main):
        assert len(request.prompt) + request.max_tokens <= MAX_CONTEXT
        assert all(0 <= token < 512 for token in request.prompt)
        if not workload.pinned:
            assert (request.pin, request.source) == (None, None)  # the router places it


def test_prefix_is_vllms_prefix_repetition_dataset(tokenizer: Any) -> None:
    shape = replace(QUICK_SHAPE, requests=12, prefixes=3, prompt_tokens=96, suffix_tokens=32)
    workload = build("prefix", shape, 0, tokenizer=tokenizer)
    assert len(workload.main) == 12
    prefixes = {r.prompt[:96] for r in workload.main}
    assert len(prefixes) == 3  # 3 prefixes, 4 requests each
    assert all(len(r.prompt) == 128 for r in workload.main)
    assert len({r.prompt for r in workload.main}) == 12
    for request in workload.main:  # the text vLLM's client sends is those very tokens
        assert request.text is not None
        assert tuple(tokenizer.encode(request.text, add_special_tokens=False)) == request.prompt
    with pytest.raises(ValueError, match="tokenizer"):
        build("prefix", shape, 0)


def test_unpinned_chat_turns_extend_each_other_and_the_router_places_them() -> None:
    shape = replace(QUICK_SHAPE, requests=7, turns=3)
    main = build("chat", shape, 0).main
    assert all(turn.pin is None for turn in main)
    for turn in main:
        if turn.after is not None:
            previous = main[turn.after]
            assert turn.prompt[: len(previous.prompt)] == previous.prompt
            assert turn.think_s == shape.think_s


def test_chat_skewed_opens_most_conversations_with_a_few_hot_openings() -> None:
    shape = replace(QUICK_SHAPE, requests=60, turns=2)
    main = build("chat-skewed", shape, 0).main
    firsts = [turn for turn in main if turn.after is None]
    opening = shape.prompt_tokens - shape.suffix_tokens
    counts: dict[tuple[int, ...], int] = {}
    for turn in firsts:
        assert len(turn.prompt) == shape.prompt_tokens
        counts[turn.prompt[:opening]] = counts.get(turn.prompt[:opening], 0) + 1
    assert len(firsts) == 30
    assert 2 <= len(counts) <= 10  # 30 conversations over 10 openings, Zipf-weighted
    assert max(counts.values()) >= 10  # the hottest opening leads a third or more
    assert len({turn.prompt for turn in firsts}) == 30  # each conversation its own message


def test_chat_turns_extend_each_other_on_alternating_engines() -> None:
    shape = replace(QUICK_SHAPE, requests=7, turns=3)
    main = build("pinned-chat", shape, 0).main
    assert len(main) == 7
    for index, turn in enumerate(main):
        if turn.after is None:  # a conversation's first turn
            assert len(turn.prompt) == shape.prompt_tokens
            continue
        previous = main[turn.after]
        assert turn.after < index
        assert turn.prompt[: len(previous.prompt)] == previous.prompt
        assert len(turn.prompt) == len(previous.prompt) + shape.output_tokens + shape.suffix_tokens
        assert {turn.pin, previous.pin} == {"a", "b"}
        assert turn.think_s == shape.think_s
    firsts = [turn for turn in main if turn.after is None]
    assert len(firsts) == 3  # 7 turns: conversations of 3, 3 and 1
    assert len({turn.prompt for turn in firsts}) == 3


def test_system_prompt_shares_one_prefix_computed_first_on_a() -> None:
    workload = build("system-prompt", QUICK_SHAPE, 0)
    (setup,) = workload.setup
    prefix = setup.prompt[: QUICK_SHAPE.prompt_tokens]
    assert setup.pin == "a"
    assert all(r.prompt[: len(prefix)] == prefix for r in workload.main)
    assert len({r.prompt for r in workload.main}) == len(workload.main)
    assert {r.pin for r in workload.main} == {"a", "b"}


def test_pd_sends_fresh_prompts_through_the_pd_router() -> None:
    workload = build("pd", QUICK_SHAPE, 0)
    assert all(r.router == "pd" and r.pin is None for r in workload.main)
    assert len({r.prompt for r in workload.main}) == len(workload.main)


def test_busy_producer_keeps_a_busy_while_b_serves_prefixes_a_holds() -> None:
    workload = build("busy-producer", QUICK_SHAPE, 0)
    held = {r.prompt for r in workload.setup}
    assert all(r.pin == "a" for r in workload.setup)
    measured = workload.measured
    background = [r for r in workload.main if not r.measured]
    assert len(background) == len(measured)
    assert all(r.pin == "a" and len(r.prompt) == QUICK_SHAPE.background_tokens
               for r in background)  # fmt: skip
    for request in measured:
        assert (request.pin, request.source) == ("b", "a")  # b pulls from busy a
        assert request.prompt[: QUICK_SHAPE.prompt_tokens] in held


# --- statistics ---------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[1.0], [3.0, 1.0], [5.0, 1.0, 4.0, 2.0, 3.0],
                                    [0.1 * i * i for i in range(37)]])
def test_percentiles_match_numpy(values: list[float]) -> None:
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


def test_percentile_of_nothing_is_none_and_bad_q_is_named() -> None:
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="percentile 101"):
        percentile([1.0], 101)


def record(sent: float, ttft: float, latency: float, **kw: object) -> RequestRecord:
    fields: dict[str, object] = {"prompt_tokens": 100, "output_tokens": 4, "cached_tokens": 64}
    fields.update(kw)
    return RequestRecord(sent, ttft, latency, **fields)  # type: ignore[arg-type]


def test_summary_counts_throughput_tokens_and_fallbacks() -> None:
    records = [
        record(0.0, 0.1, 1.0, source="a"),
        record(1.0, 0.3, 1.0, cached_tokens=0, source="a"),  # named, reused nothing
        record(2.0, 0.2, 2.0),  # ends last, at 4 s
        record(0.5, 9.9, 9.9, error="HTTP 500"),  # errors count, but not in the numbers
    ]
    cell = summarize("kvpeer", "chat", records, PeerCounters(pulled_blocks=3, failed_fetches=1))
    assert (cell.requests, cell.errors) == (4, 1)
    assert cell.ttft_p50_s == pytest.approx(0.2)
    assert cell.ttft_p99_s == pytest.approx(0.298)
    assert cell.requests_per_s == pytest.approx(3 / 4.0)
    assert cell.output_tokens_per_s == pytest.approx(12 / 4.0)
    assert (cell.prompt_tokens, cell.cached_tokens, cell.computed_tokens) == (300, 128, 172)
    assert (cell.pulled_tokens, cell.failed_fetches) == (96, 1)
    assert (cell.pulls_named, cell.pulls_fell_back) == (2, 1)
    assert cell.ttfts_s == pytest.approx([0.1, 0.2, 0.3])


def test_plans_are_set_against_their_outcomes_per_reason() -> None:
    records = [
        record(0.0, 0.1, 1.0, plan="pull", predicted_ttft_s=0.2),
        record(1.0, 0.5, 1.0, plan="pull", predicted_ttft_s=0.2),
        record(2.0, 0.9, 1.0, plan="compute: pull slower", predicted_ttft_s=1.0),
        record(3.0, 0.9, 1.0, plan="cache"),  # no prediction: not judged
        record(4.0, 9.0, 9.0, plan="pull", predicted_ttft_s=0.2, error="HTTP 500"),
    ]
    cell = summarize("kvpeer", "chat@low", records, None)
    assert cell.outcomes == {
        "compute: pull slower": {"n": 1.0, "predicted_mean_s": 1.0, "actual_mean_s": 0.9},
        "pull": {"n": 2.0, "predicted_mean_s": pytest.approx(0.2),
                 "actual_mean_s": pytest.approx(0.3)},
    }
    assert pool([cell, replace(cell, repeat=1)]).outcomes["pull"]["n"] == 4.0
    table = render([cell], [], 1.0)
    assert "kvpeer's plans against outcomes" in table
    assert "pull 2: 200ms -> 300ms" in table


def test_an_arm_without_kvpeer_has_no_pulled_count() -> None:
    cell = summarize("none", "pd", [record(0.0, 0.5, 1.0)], None)
    assert cell.pulled_tokens is None
    assert cell.failed_fetches is None


def test_ratios_are_kvpeer_over_each_baseline_per_workload() -> None:
    def cell(arm: str, workload: str, ttfts: Sequence[float]) -> Cell:
        return summarize(arm, workload, [record(i, t, 1.0) for i, t in enumerate(ttfts)], None)

    cells = [
        cell("none", "chat", [1.0, 1.0, 1.0]),
        cell("kvpeer", "chat", [0.2, 0.3, 0.5]),
        cell("vllm-p2p", "chat", [0.6, 0.6, 1.0]),
        cell("kvpeer", "pd", [0.1]),  # no baseline ran pd: no ratio
    ]
    found = {(r.workload, r.baseline): r for r in ratios(cells)}
    assert set(found) == {("chat", "none"), ("chat", "vllm-p2p")}
    assert found["chat", "none"].ttft_p50 == pytest.approx(0.3)
    assert found["chat", "vllm-p2p"].ttft_p50 == pytest.approx(0.5)
    assert found["chat", "vllm-p2p"].ttft_p99 == pytest.approx(0.496 / 0.992)


def test_pooling_repeats_takes_percentiles_over_every_request_and_sums_the_rest() -> None:
    one = summarize("kvpeer", "chat", [record(0.0, 0.1, 1.0, source="a"),
                                       record(1.0, 0.3, 1.0)], PeerCounters(pulled_blocks=2))
    two = summarize("kvpeer", "chat", [record(0.0, 0.2, 3.0),
                                       record(0.5, 9.9, 9.9, error="HTTP 500")],
                    PeerCounters(pulled_blocks=1, failed_fetches=1))  # fmt: skip
    pooled = pool([replace(one, repeat=0), replace(two, repeat=1)])
    assert pooled.repeat is None
    assert (pooled.requests, pooled.errors) == (4, 1)
    assert pooled.ttfts_s == pytest.approx([0.1, 0.2, 0.3])
    assert pooled.ttft_p50_s == pytest.approx(0.2)
    assert pooled.latency_p99_s == pytest.approx(percentile([1.0, 1.0, 3.0], 99))
    assert pooled.window_s == pytest.approx(2.0 + 3.0)  # each repeat's window, summed
    assert pooled.requests_per_s == pytest.approx(3 / 5.0)
    assert pooled.output_tokens_per_s == pytest.approx(12 / 5.0)
    assert (pooled.pulled_tokens, pooled.failed_fetches) == (96, 1)
    assert (pooled.pulls_named, pooled.cached_tokens) == (1, 192)
    assert [row["repeat"] for row in pooled.per_request] == [0, 0, 1, 1]
    none = summarize("none", "chat", [record(0.0, 1.0, 1.0)], None)
    assert pool([none, replace(none, repeat=1)]).pulled_tokens is None
    with pytest.raises(ValueError, match="mixed"):
        pool([one, none])
    with pytest.raises(ValueError, match="no cells"):
        pool([])


def test_repeats_are_compared_with_the_same_repeat_and_their_median_is_reported() -> None:
    def cell(arm: str, repeat: int, ttft: float) -> Cell:
        return replace(summarize(arm, "chat", [record(0.0, ttft, 1.0)], None), repeat=repeat)

    cells = [cell("none", 0, 1.0), cell("none", 1, 2.0), cell("none", 2, 1.0),
             cell("kvpeer", 0, 0.5), cell("kvpeer", 1, 0.2), cell("kvpeer", 2, 0.3)]
    per_repeat = ratios(cells)
    assert [(r.repeat, round(r.ttft_p50 or 0, 3)) for r in per_repeat] == [
        (0, 0.5), (1, 0.1), (2, 0.3)]  # fmt: skip
    (median,) = median_ratios(per_repeat)
    assert (median.repeat, median.baseline) == (None, "none")
    assert median.ttft_p50 == pytest.approx(0.3)
    table = render([pool(cells[:3]), pool(cells[3:])], [], 1.0, repeat_cells=cells)
    assert "3 repeats pooled" in table
    assert f"{'chat':<17} {'kvpeer/none':<25} p50  0.50x 0.10x 0.30x  median 0.30x" in table
    tiny = render([cell("none", 0, 100.0), cell("kvpeer", 0, 0.4)], [], 1.0)
    assert "p50 0.004x" in tiny  # a ratio under 0.01 keeps a digit, not 0.00x


# --- the client and the matrix, through the real router -----------------------------------


class FakeArms:
    """An :data:`OpenArm` of fake engines behind real routers: fresh engines per arm
    (their ``cached_tokens`` tell arms apart); ``vllm-p2p`` can be made unavailable."""

    def __init__(self, unavailable: Mapping[str, str] | None = None) -> None:
        self.unavailable = dict(unavailable or {})
        self.opened: list[str] = []
        self.engines: dict[str, list[FakeEngine]] = {}
        self.waited: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def __call__(self, arm: str) -> Iterator[ArmFleet]:
        if arm in self.unavailable:
            raise ArmUnavailable(self.unavailable[arm])
        self.opened.append(arm)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()

        def on_loop(coro: object) -> None:
            asyncio.run_coroutine_threadsafe(coro, loop).result(10)  # type: ignore[arg-type]

        fakes = [FakeEngine(name, Behaviour(cached_tokens=CACHED_BY_ARM[arm], chunks=3))
                 for name in ("a", "b")]  # fmt: skip
        self.engines[arm] = fakes
        try:
            for fake in fakes:
                on_loop(fake.start())

            def specs(*roles: Role) -> tuple[EngineEntry, ...]:
                return tuple(EngineEntry(EngineSpec(f.name, f.url, "127.0.0.1", 5710 + i, role))
                             for i, (f, role) in enumerate(zip(fakes, roles, strict=True)))

            with (
                BackgroundRouter(RouterConfig(Mode.SHARED, specs(Role.BOTH, Role.BOTH),
                                              listen_port=0, allow_pinning=True,
                                              policy=ARM_POLICIES[arm])) as shared,
                BackgroundRouter(RouterConfig(Mode.PD, specs(Role.PREFILL, Role.DECODE),
                                              listen_port=0)) as pd,
            ):  # fmt: skip
                yield _FakeFleet(self, arm, {"shared": shared.url, "pd": pd.url}, shared)
        finally:
            for fake in fakes:
                on_loop(fake.stop())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


class _FakeFleet:
    def __init__(self, arms: FakeArms, arm: str, urls: Mapping[str, str],
                 shared: BackgroundRouter) -> None:  # fmt: skip
        self._arms, self._arm, self._urls, self.shared = arms, arm, urls, shared

    @property
    def urls(self) -> Mapping[str, str]:
        return self._urls

    def counters(self) -> PeerCounters | None:
        return PeerCounters() if self._arm == "kvpeer" else None

    def fleet_counters(self) -> FleetCounters:
        return FleetCounters(plans=router_plans(self.shared))

    def wait_indexed(self, held: Sequence[tuple[str, Sequence[int]]], timeout_s: float) -> None:
        self._arms.waited.extend((engine, len(prompt)) for engine, prompt in held)


def test_the_client_records_what_each_request_saw() -> None:
    arms = FakeArms()
    with arms("kvpeer") as fleet:
        requests = [
            BenchRequest(0.0, tuple(range(3, 99)), 3, pin="b"),
            BenchRequest(0.0, tuple(range(3, 67)), 3, router="pd"),
            BenchRequest(0.0, tuple(range(3, 35)), 3, pin="a", after=0),
        ]
        records = asyncio.run(run_phase(requests, fleet.urls))
    a, _b = arms.engines["kvpeer"]
    assert [r.engine for r in records] == ["b", "b", "a"]
    assert [r.prompt_tokens for r in records] == [96, 64, 32]
    assert all(r.error is None and r.output_tokens == 3 and r.cached_tokens == 64
               for r in records)  # fmt: skip
    assert all(0 < r.ttft_s <= r.latency_s for r in records)
    assert records[2].sent_s >= records[0].done_s  # sent after the one it follows
    prefill_legs = [body for body in a.generation_bodies() if body["max_tokens"] == 1]
    assert len(prefill_legs) == 1  # the pd request's prefill leg ran on a


def test_a_failed_request_is_a_record_not_an_exception() -> None:
    arms = FakeArms()
    with arms("none") as fleet:
        for fake in arms.engines["none"]:
            fake.behaviour.fail_status = 400  # 4xx: the router does not retry elsewhere
        records = asyncio.run(run_phase([BenchRequest(0.0, (5, 6, 7), 2, pin="a")], fleet.urls))
    (only,) = records
    assert only.error is not None
    assert "400" in only.error


def test_the_matrix_runs_every_arm_on_fresh_engines_and_every_workload(tmp_path: Path) -> None:
    pinned = ("pinned-chat", "busy-producer", "pd")
    spec = ServeBenchSpec(shape=TINY, workloads=pinned)
    arms = FakeArms()
    progress: list[str] = []
    result = run_matrix(spec, arms, progress.append)
    assert arms.opened == list(PINNED_ARMS)  # affinity and load place, they never pin
    assert "arm affinity: none of the chosen workloads applies to it; not started" in progress
    assert len({id(fake) for fakes in arms.engines.values() for fake in fakes}) == 6
    assert [(c.arm, c.workload) for c in result.cells] == [
        (arm, workload) for arm in PINNED_ARMS for workload in pinned
    ]
    assert result.ok
    assert not result.errors
    for cell in result.cells:
        assert cell.requests == TINY.requests
        assert cell.errors == 0
        assert cell.cached_tokens == CACHED_BY_ARM[cell.arm] * TINY.requests
        assert (cell.pulled_tokens is None) == (cell.arm != "kvpeer")
        assert cell.ttft_p50_s is not None
        assert cell.requests_per_s is not None
    # busy-producer's setup parks one prefix per measured request on a, then waits for it
    assert arms.waited.count(("a", TINY.prompt_tokens)) == TINY.requests * len(PINNED_ARMS)
    # the producer's background prefills reached a and were not counted
    a = arms.engines["kvpeer"][0]
    background = [b for b in a.generation_bodies() if len(b["prompt"]) == TINY.background_tokens]
    assert len(background) == TINY.requests
    assert any("kvpeer/pinned-chat: TTFT mean" in line for line in progress)

    table = render(result.cells, result.errors, result.seconds)
    for workload in pinned:
        assert f"{workload:<17} kvpeer/none" in table
        assert f"{workload:<17} kvpeer/vllm-p2p" in table
    decoded = json.loads(json.dumps(result.to_json()))
    assert len(decoded["cells"]) == 9
    assert len(decoded["ratios"]) == 6
    assert decoded["spec"]["shape"]["requests"] == TINY.requests

    out = tmp_path / "ttft.png"
    plot(result.cells, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unpinned_workloads_run_on_every_placing_arm_at_two_probed_loads(
    tokenizer: Any,
) -> None:
    shape = replace(TINY, requests=6, prefixes=2, turns=2)
    spec = ServeBenchSpec(shape=shape, workloads=UNPINNED)
    arms = FakeArms()
    progress: list[str] = []
    result = run_matrix(spec, arms, progress.append, tokenizer=tokenizer)
    placing = ["affinity", "load", "kvpeer", "kvpeer-affinity", "vllm-p2p"]
    assert arms.opened == placing  # none only runs pinned workloads
    assert "arm none: none of the chosen workloads applies to it; not started" in progress
    assert result.ok
    # probed once per workload, on the first arm; every arm then offers the same loads
    probes = [line for line in progress if line.startswith("probe ") and "answered" in line]
    assert len(probes) == 3
    assert set(result.loads) == set(UNPINNED)
    assert all(0 < low < high for low, high in result.loads.values())
    expected = [(arm, f"{name}@{level}") for arm in placing for name in UNPINNED
                for level in ("low", "high")]  # fmt: skip
    assert [(c.arm, c.workload) for c in result.cells] == expected
    for cell in result.cells:
        name, level = cell.workload.split("@")
        assert cell.offered_rate == result.loads[name][("low", "high").index(level)]
        assert cell.errors == 0
        assert cell.ttft_mean_s is not None
        assert all(row["engine"] in ("a", "b") for row in cell.per_request)  # router headers
        if cell.arm != "load":  # the KV-aware core says why and what it predicted
            assert all(row["plan"] in cell.plans and row["predicted_ttft_s"] is not None
                       for row in cell.per_request)  # fmt: skip
            assert set(cell.outcomes) <= set(cell.plans)
        assert sum(cell.plans.values()) == cell.requests  # each request planned once
        if cell.arm == "load":
            assert cell.plans == {"load only": cell.requests}
        else:
            assert "load only" not in cell.plans
        if cell.arm == "affinity":
            assert not {"pull", "compute: pull slower"} & set(cell.plans)
    # sent by vLLM's benchmark request function (it adds repetition_penalty), as text
    bodies = [b for fake in arms.engines["kvpeer"] for b in fake.generation_bodies()]
    sent = [b for b in bodies if "repetition_penalty" in b]
    assert len(sent) >= 6 * len(UNPINNED) * 2
    assert all(isinstance(b["prompt"], str) and b["ignore_eos"] for b in sent)
    found = {(r.workload, r.baseline) for r in ratios(result.cells)}
    for name in UNPINNED:
        assert {(f"{name}@low", "affinity"), (f"{name}@high", "vllm-p2p")} <= found
    table = render(result.cells, result.errors, result.seconds)
    assert "router plans by reason" in table
    assert f"{'chat-skewed@high':<17} kvpeer/affinity" in table
    decoded = json.loads(json.dumps(result.to_json()))
    assert set(decoded["loads"]) == set(UNPINNED)
    assert decoded["cells"][0]["plans"]

    given = run_matrix(replace(spec, loads=(1.0, 2.0), arms=("affinity",), workloads=("chat",)),
                       FakeArms(), progress.append)  # fmt: skip
    assert given.loads == {"chat": (1.0, 2.0)}
    assert [c.offered_rate for c in given.cells] == [1.0, 2.0]
    assert len([line for line in progress if line.startswith("probe ")]) == len(probes) * 2


def test_repeats_run_each_seed_on_the_same_engines_and_pool_per_arm_and_workload() -> None:
    spec = ServeBenchSpec(arms=("none", "kvpeer"), shape=TINY, workloads=("pinned-chat", "pd"),
                          repeats=2)  # fmt: skip
    arms = FakeArms()
    progress: list[str] = []
    result = run_matrix(spec, arms, progress.append)
    assert arms.opened == ["none", "kvpeer", "none", "kvpeer"]  # arms in turns, fresh each
    assert [(c.arm, c.workload, c.repeat) for c in result.repeat_cells] == [
        (arm, workload, k) for k in (0, 1) for arm in ("none", "kvpeer")
        for workload in ("pinned-chat", "pd")
    ]  # fmt: skip  (arms in turns: none, kvpeer, none, kvpeer)
    assert [(c.arm, c.workload, c.repeat) for c in result.cells] == [
        (arm, workload, None) for arm in ("none", "kvpeer") for workload in ("pinned-chat", "pd")
    ]  # fmt: skip
    assert all(c.requests == 2 * TINY.requests for c in result.cells)
    # repeat k sends seed k's prompts: the second repeat's chat is not the first's
    a = arms.engines["none"][0]
    first_turns = [tuple(b["prompt"]) for b in a.generation_bodies()
                   if len(b["prompt"]) == TINY.prompt_tokens]  # fmt: skip
    assert len(set(first_turns)) == len(first_turns) >= 2
    assert any("kvpeer/pinned-chat (turn 2/2): TTFT mean" in line for line in progress)
    decoded = json.loads(json.dumps(result.to_json()))
    assert len(decoded["repeat_cells"]) == 8
    assert len(decoded["repeat_ratios"]) == 4  # kvpeer/none per workload per repeat
    assert {(r["workload"], r["repeat"]) for r in decoded["median_ratios"]} == {
        ("pinned-chat", None), ("pd", None)}  # fmt: skip
    table = render(result.cells, result.errors, result.seconds, repeat_cells=result.repeat_cells)
    assert "2 repeats pooled" in table
    assert "median" in table
    single = run_matrix(replace(spec, repeats=1, workloads=("pd",)), FakeArms(), lambda _: None)
    assert single.repeat_cells == []
    assert [c.repeat for c in single.cells] == [0, 0]
    assert "median" not in render(single.cells, single.errors, single.seconds)


def test_an_arm_that_stops_after_one_repeat_is_still_compared_pooled_with_pooled() -> None:
    class StopsInRepeat2(_FakeFleet):
        calls = 0

        def counters(self) -> PeerCounters | None:
            StopsInRepeat2.calls += 1
            if StopsInRepeat2.calls > 2:  # before and after repeat 1; repeat 2 fails
                raise ArmUnavailable("engine b died")
            return PeerCounters()

    class Arms(FakeArms):
        @contextlib.contextmanager
        def __call__(self, arm: str) -> Iterator[ArmFleet]:
            with super().__call__(arm) as fleet:
                if arm != "kvpeer":
                    yield fleet
                    return
                assert isinstance(fleet, _FakeFleet)
                yield StopsInRepeat2(self, arm, fleet.urls, fleet.shared)

    spec = ServeBenchSpec(arms=("none", "kvpeer"), shape=TINY, workloads=("pd",), repeats=2)
    result = run_matrix(spec, Arms(), lambda _: None)
    assert [(c.arm, c.repeat) for c in result.repeat_cells] == [
        ("none", 0), ("kvpeer", 0), ("none", 1)]  # fmt: skip
    assert [(c.arm, c.repeat, c.requests) for c in result.cells] == [
        ("none", None, 2 * TINY.requests), ("kvpeer", None, TINY.requests)]  # fmt: skip
    assert [(r.baseline, r.repeat) for r in ratios(result.cells)] == [("none", None)]
    assert result.errors[0].reason == "engine b died"


def test_an_arm_that_fails_unexpectedly_costs_only_its_own_cells() -> None:
    """Seen for real: vLLM p2p engines starved the router's thread and a call into it
    timed out during that arm's warm-up; the whole run ended and the arms already
    measured were lost. Now the arm is reported and the others' cells are kept."""

    class Arms(FakeArms):
        @contextlib.contextmanager
        def __call__(self, arm: str) -> Iterator[ArmFleet]:
            if arm == "vllm-p2p":
                raise TimeoutError()
            with super().__call__(arm) as fleet:
                yield fleet

    spec = ServeBenchSpec(shape=TINY, workloads=("pd",))
    progress: list[str] = []
    result = run_matrix(spec, Arms(), progress.append)
    assert [c.arm for c in result.cells] == ["none", "kvpeer"]
    assert [(e.arm, e.reason) for e in result.errors] == [("vllm-p2p", "failed: TimeoutError")]
    assert "arm vllm-p2p failed: TimeoutError" in progress
    assert not result.ok
    assert "kvpeer/none" in render(result.cells, result.errors, result.seconds)


def test_an_arm_that_cannot_run_is_named_and_the_others_still_run() -> None:
    spec = ServeBenchSpec(shape=TINY, workloads=("system-prompt",))
    arms = FakeArms({"vllm-p2p": "vLLM's p2p tier runs on NIXL, which is not usable here"})
    progress: list[str] = []
    result = run_matrix(spec, arms, progress.append)
    assert arms.opened == ["none", "kvpeer"]
    assert [c.arm for c in result.cells] == ["none", "kvpeer"]
    assert not result.ok
    reason = "arm vllm-p2p did not run: vLLM's p2p tier runs on NIXL, which is not usable here"
    assert reason in progress
    table = render(result.cells, result.errors, result.seconds)
    assert reason in table
    assert "kvpeer/none" in table
    assert "kvpeer/vllm-p2p" not in table
    assert result.to_json()["arms_not_run"] == [
        {"arm": "vllm-p2p", "reason": "vLLM's p2p tier runs on NIXL, which is not usable here"}
    ]


def test_shapes_scale_the_cpu_tier_to_the_busy_producers_prefixes() -> None:
    small = ServeBenchSpec(shape=TINY).cpu_bytes()
    big = ServeBenchSpec(shape=replace(TINY, requests=40)).cpu_bytes()
    assert big > small >= 256 << 20
    assert math.isfinite(big)


def test_shape_chat_tokens_counts_every_turn() -> None:
    shape = Shape(requests=1, rate=1.0, prompt_tokens=100, suffix_tokens=10, output_tokens=5,
                  turns=3, background_tokens=64, think_s=0.0)  # fmt: skip
    assert shape.chat_tokens() == 100 + 2 * 15 + 5


def test_a_kvpeer_engine_with_held_blocks_is_named_so_to_the_router() -> None:
    """The kvpeer arm's engines hold blocks; the router must know, or it predicts a wait
    for the source's engine that the pull no longer has (and flags carry it too)."""
    from kvpeer.lab.bench.routerproc import engine_flag
    from kvpeer.lab.engines.serving import ServeSpec
    from kvpeer.router.config import parse_engine_flag

    held = ServeSpec("a", Path("/m"), tier_options={"held_bytes": 1 << 20}).router_engine()
    assert held.serves_held
    assert ServeSpec("a", Path("/m")).router_engine().serves_held  # the tier's default
    assert not ServeSpec("a", Path("/m"), tier_options={"held_bytes": 0}).router_engine(
    ).serves_held
    assert not ServeSpec("a", Path("/m"), data_plane="tcp").router_engine().serves_held
    assert not ServeSpec("a", Path("/m"), tier="none",
                         tier_options={"held_bytes": 1 << 20}).router_engine().serves_held
    assert parse_engine_flag(engine_flag(held))["held"] == "true"
