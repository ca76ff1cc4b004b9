"""The fleet model: its engine and link against hand-computed cases, the router's own
code in the loop, determinism, and zero reuse where nothing is shared."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from kvpeer.cli import main
from kvpeer.lab.fleet.engine import Fetched, Job, SimEngine
from kvpeer.lab.fleet.grid import run_at_load, summary
from kvpeer.lab.fleet.link import Network
from kvpeer.lab.fleet.params import LINKS, GpuModel, LinkModel
from kvpeer.lab.fleet.world import FleetSpec, run_fleet
from kvpeer.lab.trace.mooncake import TraceRequest
from kvpeer.router.decide import RouterPolicy
from kvpeer.router.kvevents import KVEvent
from kvpeer.router.policy import EngineLoad, Outcome, Plan

# 1 ms per token of compute, 10 ms per step, no attention term, decode compute-bound.
SIMPLE = GpuModel(params=5e8, layers=1, hidden=0, peak_flops=1e12, mfu=1.0,
                  weight_bytes=0.0, kv_bytes_per_token=1, hbm_bytes_s=1e12,
                  step_overhead_s=0.01, step_tokens=100, kv_tokens=100_000,
                  cpu_tier_bytes=1e6, pcie_bytes_s=1e3)


def request(
    ts_ms: float, length: int, ids: Sequence[int], out: int = 1, bt: int = 16
) -> TraceRequest:
    return TraceRequest(1, ts_ms, length, out, tuple(ids), bt)


class Host:
    """A world of one engine: a clock, and fetches as the test says."""

    def __init__(self, fetch: Fetched | None = None) -> None:
        self.now = 0.0
        self.queue: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = 0
        self.fetched = fetch
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}

    def schedule(self, at: float, action: Callable[[float], None]) -> None:
        self.seq += 1
        self.queue.append((at, self.seq, action))

    def fetch(self, engine: SimEngine, job: Job, local: int, now: float) -> Fetched:
        return self.fetched or Fetched(local, now)

    def publish(self, engine: str, events: list[KVEvent]) -> None:
        pass

    def block_tokens(self, block: int) -> tuple[int, ...]:
        return (block,) * 16

    def first_token(self, job: Job, now: float) -> None:
        self.first[job.rid] = now

    def finished(self, job: Job, now: float) -> None:
        self.done[job.rid] = now

    def run(self) -> None:
        while self.queue:
            self.queue.sort()
            at, _, action = self.queue.pop(0)
            self.now = at
            action(at)


def engine(host: Host) -> SimEngine:
    return SimEngine("e0", SIMPLE, host, block_tokens=16)


def test_a_prompt_is_prefilled_in_chunks_of_the_step_budget() -> None:
    host = Host()
    e = engine(host)
    e.submit(Job("a", request(0, 250, range(16)), 0.0), 0.0)
    host.run()
    # 100 + 100 + 50 tokens: three steps of 10 ms + 1 ms a token
    assert host.first["a"] == pytest.approx(3 * 0.010 + 0.250)


def test_decode_steps_follow_the_first_token() -> None:
    host = Host()
    e = engine(host)
    e.submit(Job("a", request(0, 50, range(4), out=5), 0.0), 0.0)
    host.run()
    assert host.first["a"] == pytest.approx(0.010 + 0.050)
    # four more tokens, one step each: 10 ms + 1 token of compute (memory is ~0)
    assert host.done["a"] == pytest.approx(host.first["a"] + 4 * 0.011)


def test_a_repeated_prompt_computes_only_what_its_cache_lacks() -> None:
    host = Host()
    e = engine(host)
    e.submit(Job("a", request(0, 64, range(4)), 0.0), 0.0)
    host.run()
    e.submit(Job("b", request(0, 64, range(4)), host.now), host.now)
    start = host.now
    host.run()
    # 64 tokens = 4 full blocks; the last token is always computed: 3 blocks cached
    assert host.first["b"] - start == pytest.approx(0.010 + 0.016)


def test_a_fetched_prefix_waits_for_its_landing_then_computes_the_rest() -> None:
    host = Host(Fetched(blocks=2, ready_at=0.5))
    e = engine(host)
    e.submit(Job("a", request(0, 64, range(4)), 0.0), 0.0)
    host.run()
    assert host.first["a"] == pytest.approx(0.5 + 0.010 + 0.032)


def test_an_arrival_cuts_a_decode_only_span_after_the_step_under_way() -> None:
    host = Host()
    e = engine(host)
    e.submit(Job("a", request(0, 10, [1], out=101), 0.0), 0.0)
    host.schedule(0.1, lambda t: e.submit(Job("b", request(0, 10, [2]), t), t))
    host.run()
    first_a = 0.010 + 0.010
    # b arrives mid-step (steps of 11 ms after a's first token); it runs in the next step
    steps_before = int((0.1 - first_a) / 0.011) + 1
    assert host.first["b"] == pytest.approx(first_a + steps_before * 0.011 + 0.010 + 0.011)


def test_a_link_queues_transfers_per_nic() -> None:
    net = Network(LinkModel("t", 1e9, 1e-3, setup_s=0.0))
    first = net.transfer("a", "b", 10**9, 0.0)
    second = net.transfer("a", "c", 10**9, 0.5)  # a's NIC is busy until 1.002
    third = net.transfer("d", "e", 10**9, 0.5)
    assert first == pytest.approx(1.002)
    assert second == pytest.approx(2.004)
    assert third == pytest.approx(1.502)
    assert net.bytes_moved == 3 * 10**9


def shared_trace(n: int = 40, shared: bool = True) -> list[TraceRequest]:
    """Conversations of four turns: each turn's prompt extends the previous one."""
    out = []
    for i in range(n):
        conv, turn = divmod(i, 4)
        base = 1000 * conv if shared else 1000 * i
        ids = [base + k for k in range(4 * (turn + 1))] if shared else [base + k for k in range(8)]
        out.append(TraceRequest(i + 1, 250.0 * i, len(ids) * 512 - 100, 20, tuple(ids)))
    return out


def test_the_model_drives_the_routers_own_decision_code(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = RouterPolicy.plan

    def counted(self: RouterPolicy, *args: object, **kwargs: object) -> object:
        calls.append(args[0])
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(RouterPolicy, "plan", counted)
    result = run_fleet(FleetSpec(engines=4, policy="kvpeer"), shared_trace(12))
    assert len(calls) == 12
    assert result.requests == 12

    def replaced(self: RouterPolicy, *args: object, **kwargs: object) -> object:
        raise AssertionError("the router's decision function was replaced")

    monkeypatch.setattr(RouterPolicy, "plan", replaced)
    with pytest.raises(AssertionError, match="replaced"):
        run_fleet(FleetSpec(engines=4, policy="affinity"), shared_trace(12))


def test_a_run_is_determined_by_its_seed() -> None:
    trace = shared_trace()
    one = run_at_load(FleetSpec(engines=4, policy="kvpeer", seed=3), trace, 0.9)
    two = run_at_load(FleetSpec(engines=4, policy="kvpeer", seed=3), trace, 0.9)
    assert one.ttfts == two.ttfts
    a, b = summary(one, 0.9), summary(two, 0.9)
    a.pop("router_cpu_us_per_decision")
    b.pop("router_cpu_us_per_decision")
    assert a == b


@pytest.mark.parametrize("policy", ["load", "affinity", "kvpeer", "pooled", "infinite"])
def test_a_trace_with_no_shared_ids_gives_zero_reuse(policy: str) -> None:
    result = run_at_load(FleetSpec(engines=4, policy=policy), shared_trace(24, shared=False), 0.7)
    assert result.reuse == 0.0
    assert result.bytes_moved == 0


def test_shared_prefixes_are_reused_and_bounded_by_the_infinite_cache() -> None:
    trace = shared_trace()
    infinite = run_at_load(FleetSpec(engines=4, policy="infinite"), trace, 0.7).reuse
    kvpeer = run_at_load(FleetSpec(engines=4, policy="kvpeer"), trace, 0.7).reuse
    assert 0.0 < kvpeer <= infinite


def test_the_command_runs_a_small_trace_to_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
        for r in shared_trace(16)
    ))
    assert main(["lab", "fleet", "--trace", str(path), "--engines", "2,4", "--load", "0.6",
                 "--link", "rdma,tcp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["facts"]["requests"] == 16
    rows = {(r["engines"], r["policy"], r["link"]) for r in out["runs"]}
    assert (4, "kvpeer", "tcp") in rows
    assert (4, "affinity", "tcp") not in rows  # no pulls: one run serves every link
    assert all("reuse_vs_pooled" in r for r in out["runs"])
    assert all(r["held_sync"] for r in out["runs"])  # the router's defaults for kvpeer tiers
    assert main(["lab", "fleet", "--trace", str(path), "--engines", "2", "--policy", "kvpeer",
                 "--no-held-sync", "--json"]) == 0
    assert not any(r["held_sync"] for r in json.loads(capsys.readouterr().out)["runs"])
    assert main(["lab", "fleet", "--trace", str(path), "--link", "carrier-pigeon"]) == 2


def test_a_saved_result_is_rendered_and_plotted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
        for r in shared_trace(8)
    ))
    assert main(["lab", "fleet", "--trace", str(path), "--engines", "2", "--load", "0.5,0.9",
                 "--json"]) == 0
    saved = tmp_path / "out.json"
    saved.write_text(capsys.readouterr().out)
    pytest.importorskip("matplotlib")
    assert main(["lab", "fleet", "--from-json", str(saved), "--plot",
                 str(tmp_path / "p.png")]) == 0
    assert "kvpeer" in capsys.readouterr().out
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_held_blocks_and_sync_pulls_are_a_run_option_and_reported() -> None:
    trace = shared_trace()
    slow = run_at_load(FleetSpec(engines=4, policy="kvpeer"), trace, 0.9)
    fast = run_at_load(FleetSpec(engines=4, policy="kvpeer", held_sync=True), trace, 0.9)
    assert summary(fast, 0.9)["held_sync"] is True
    assert fast.requests == slow.requests


class Scripted:
    """A policy that places each request as the test says: rid -> (engine, source)."""

    def __init__(self, places: dict[str, tuple[int, int | None]], names: Sequence[str]) -> None:
        self._places = places
        self._names = names

    def plan(self, request_id: str, prompt: Sequence[int], loads: Mapping[str, EngineLoad],
             now: float, *, serve_on: str | None = None, pull_from: str | None = None,
             ) -> Plan:  # fmt: skip
        engine, source = self._places[request_id]
        return Plan(self._names[engine],
                    source=None if source is None else self._names[source])

    def on_sent(self, request_id: str, plan: Plan, prompt: Sequence[int], now: float) -> None:
        pass

    def on_outcome(self, outcome: Outcome, now: float) -> None:
        pass

    def on_engine_restart(self, engine: str, now: float) -> None:
        pass


def test_pulling_ahead_starts_the_pull_when_the_router_sends_the_request() -> None:
    """By hand (SIMPLE: 10 ms a step, 1 ms a token, 100-token budget; 10 MB of KV a token
    over TCP; blocks of 16 tokens):

    r0 (t=0, 64 tokens) is computed on A: first token 0.010 + 0.064; A's tier holds its
    4 blocks, 3 of them usable by a 64-token prompt. r1 (t=0.1, 200 fresh tokens) is
    computed on B in two steps of 100: 0.1 + 2 x 0.110 = 0.32. r2 (t=0.12, r0's prompt) goes
    to B with A named as its source; it reaches the head of B's queue at 0.21, when r1's
    first step ends. Its 48 tokens (480 MB) take 0.0005 + 2 x 50 us + 480e6 / 2.8125e9 s
    on TCP, and 0.48 ms to load. Pulling ahead, the pull starts at 0.12 and lands before
    r1's second step ends; r2 then computes its last 16 tokens in one step: 0.346.
    Pulled at the lookup, it starts at 0.21 and lands after B went idle at 0.32."""
    gpu = replace(SIMPLE, kv_bytes_per_token=10_000_000, pcie_bytes_s=1e12,
                  cpu_tier_bytes=1e12)
    trace = [request(0, 64, [0, 1, 2, 3]), request(100, 200, range(10, 23)),
             request(120, 64, [0, 1, 2, 3])]
    places = {"r0": (0, None), "r1": (1, None), "r2": (1, 0)}
    transfer = LINKS["tcp"].transfer_s(48 * 10_000_000)
    load = 48 * 10_000_000 / 1e12
    assert transfer == pytest.approx(0.0005 + 1e-4 + 480e6 / 2.8125e9)

    def ttfts(ahead: bool) -> tuple[float, ...]:
        spec = FleetSpec(engines=2, policy="kvpeer", link="tcp", gpu=gpu, held_sync=True,
                         ahead=ahead)
        result = run_fleet(spec, trace, policy=lambda names: Scripted(places, names))
        assert (result.pulls, result.fetched_blocks) == (1, 3)
        return result.ttfts

    r2_done = 0.32 + 0.010 + 0.016  # after r1's last step, one step of 16 tokens
    assert ttfts(ahead=True) == pytest.approx((0.074, 0.22, r2_done - 0.12))
    landed = 0.21 + transfer + load  # later than r1's first token at 0.32
    assert landed > 0.32
    assert ttfts(ahead=False) == pytest.approx((0.074, 0.22, landed + 0.026 - 0.12))
