"""Engines sharing one host's cores with their front end (``kvpeer.lab.fleet.hostcpu``):
the sharing factor, re-rating a step under way, the front-end stage, against
hand-computed cases; and the GPU presets untouched by it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvpeer.lab.fleet.engine import Job, SimEngine
from kvpeer.lab.fleet.hostcpu import FrontEnd, HostCpu, sharing_factor
from kvpeer.lab.fleet.params import ENGINES, GpuModel
from kvpeer.lab.fleet.world import FleetSpec, run_fleet
from tests.fleet.test_fleet import SIMPLE, Host, request

# SIMPLE: 10 ms a step + 1 ms a token, so a 90-token prompt is one step of 0.1 s.


def test_threads_beyond_the_cores_share_them() -> None:
    assert sharing_factor(2, 0.0, 2) == 1.0  # two engines, two cores: each has one
    assert sharing_factor(3, 0.0, 2) == 1.5
    assert sharing_factor(1, 0.0, 0) == 1.0  # no host: nothing shared
    # streaming: 1 core of front end at full speed, slowed with the rest:
    # k N = B + S / k  ->  2k = 2 + 1/k  ->  k = (2 + sqrt(12)) / 4
    k = sharing_factor(2, 1.0, 2)
    assert k == pytest.approx((2 + math.sqrt(12)) / 4)
    assert 2 * k == pytest.approx(2 + 1 / k)


class User:
    """An engine as the host sees it, stepping or not."""

    def __init__(self, stepping: bool, stream_rate: float = 0.0) -> None:
        self.stepping = stepping
        self.stream_rate = stream_rate
        self.factors: list[float] = []

    def rerate(self, now: float, factor: float) -> None:
        self.factors.append(factor)


def test_streamed_tokens_and_a_second_engine_slow_the_steps() -> None:
    # 400 tokens/s of own work streamed at 5 ms of front end each: 2 cores of demand
    cpu = HostCpu(2, 0.005, co_run_slowdown=1.5)
    decoding, idle = User(True, 400.0), User(False)
    cpu.attach(decoding)
    cpu.attach(idle)
    cpu.changed(0.0)
    k = (1 + math.sqrt(1 + 4 * 2 * 2.0)) / 4  # B = 1, S = 2, N = 2
    assert cpu.factor == pytest.approx(k)
    assert decoding.factors[-1] == pytest.approx(k)  # alone: no co-run slowdown
    idle.stepping = True
    cpu.changed(0.0)
    k = (2 + math.sqrt(4 + 16)) / 4  # B = 2
    assert decoding.factors[-1] == pytest.approx(1.5 * k)
    assert idle.factors[-1] == pytest.approx(1.5 * k)


def test_an_engines_scheduler_is_counted_while_it_steps() -> None:
    cpu = HostCpu(2, 0.0, scheduler_cores=0.5)
    a, b = User(True), User(False)
    cpu.attach(a)
    cpu.attach(b)
    cpu.changed(0.0)
    assert cpu.factor == 1.0  # 1.5 threads on 2 cores
    b.stepping = True
    cpu.changed(0.0)
    assert cpu.factor == pytest.approx(1.5)  # 3 threads on 2 cores


def engines(cores: int, n: int = 2) -> tuple[Host, HostCpu, list[SimEngine]]:
    host = Host()
    cpu = HostCpu(cores, 0.0)
    return host, cpu, [SimEngine(f"e{i}", SIMPLE, host, block_tokens=16, cpu=cpu)
                       for i in range(n)]


def test_a_step_under_way_is_re_rated_when_another_engine_starts() -> None:
    """One core: e0's 0.1 s step from 0; e1's from 0.05 halves both. e0 has 0.05 s of
    work left at 0.05 and does it at half speed: 0.15. e1 did 0.05 s of work by then and
    does the rest alone: 0.2."""
    host, _, (e0, e1) = engines(1)
    e0.submit(Job("a", request(0, 90, range(5)), 0.0), 0.0)
    host.schedule(0.05, lambda t: e1.submit(Job("b", request(0, 90, range(10, 15)), t), t))
    host.run()
    assert host.first["a"] == pytest.approx(0.15)
    assert host.first["b"] == pytest.approx(0.20)


def test_two_engines_on_two_cores_do_not_share_a_core() -> None:
    host, _, (e0, e1) = engines(2)
    e0.submit(Job("a", request(0, 90, range(5)), 0.0), 0.0)
    e1.submit(Job("b", request(0, 90, range(10, 15)), 0.0), 0.0)
    host.run()
    assert host.first == {"a": pytest.approx(0.1), "b": pytest.approx(0.1)}


def test_a_front_end_stage_takes_its_cpu_then_queues_the_request() -> None:
    """One core: e0 computes a's 0.1 s step from 0; b's front-end stage (0.05 s of CPU)
    runs beside it, both at half speed, and ends at 0.1 with e0 half done; b queues then
    and is computed after a: a at 0.15, b at 0.25."""
    host, cpu, (e0,) = engines(1, 1)
    front = FrontEnd(cpu, 0.05, host.schedule)
    e0.submit(Job("a", request(0, 90, range(5)), 0.0), 0.0)
    queued: list[float] = []

    def queue(t: float) -> None:
        queued.append(t)
        e0.submit(Job("b", request(0, 90, range(10, 15)), t), t)

    front.submit(queue, 0.0)
    host.run()
    assert queued == [pytest.approx(0.1)]
    assert host.first == {"a": pytest.approx(0.15), "b": pytest.approx(0.25)}


def test_front_end_stages_of_one_engine_run_one_at_a_time() -> None:
    host, cpu, _ = engines(8, 0)
    front = FrontEnd(cpu, 0.02, host.schedule)
    ends: list[float] = []
    for _ in range(3):
        front.submit(ends.append, 0.0)
    host.run()
    assert ends == [pytest.approx(0.02), pytest.approx(0.04), pytest.approx(0.06)]


def test_the_world_shares_the_host_when_the_preset_has_cores() -> None:
    """Two requests at 0 to two engines (the load policy spreads them) on a 2-core host:
    each front end's stage (20 ms, two threads on two cores) and then the two steps at
    once, slowed 1.5x by each other: 0.02 + 0.1 x 1.5."""
    gpu = replace(SIMPLE, host_cores=2, frontend_s_per_request=0.02, co_run_slowdown=1.5)
    requests = [request(0, 90, range(5)), request(0, 90, range(10, 15))]
    result = run_fleet(FleetSpec(engines=2, policy="load", gpu=gpu), requests)
    assert result.ttfts == pytest.approx((0.17, 0.17))
    plain = run_fleet(FleetSpec(engines=2, policy="load", gpu=SIMPLE), requests)
    assert plain.ttfts == pytest.approx((0.1, 0.1))


def test_gpu_presets_share_no_host() -> None:
    h100 = ENGINES["h100"]
    assert (h100.host_cores, h100.frontend_s_per_request, h100.frontend_s_per_token,
            h100.co_run_slowdown) == (0, 0.0, 0.0, 1.0)
    assert GpuModel().host_cores == 0
