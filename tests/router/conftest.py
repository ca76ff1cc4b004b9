"""Router test kit: fake engines and a router on loopback, real HTTP between them.

Tests are plain functions that call :func:`run` on one coroutine (no async plugin): the
fakes, the router and the test's client share that coroutine's event loop, so a test
steers an engine (fail, hang, hold its last chunk) and observes the router directly.
Waiting is always on an event or condition with a bounded timeout, never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpeer.lab.engines.fakeengine import FakeEngine
from kvpeer.router.app import Router
from kvpeer.router.config import RouterConfig, from_mapping
from kvpeer.router.loadonly import LoadOnlyPolicy
from kvpeer.router.policy import EngineLoad, EngineSpec, Mode, Outcome, Plan

T = TypeVar("T")
TEST_TIMEOUT_S = 30.0


def run(coro: Coroutine[Any, Any, T], timeout: float = TEST_TIMEOUT_S) -> T:
    """Run one test scenario on a fresh event loop, bounded."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait for what the router's tasks bring about (polled, bounded; no fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


@dataclass
class RecordingPolicy:
    """Load-only choices (or ``choose``'s), with every call the edge made recorded."""

    engines: Sequence[EngineSpec]
    mode: Mode
    choose: Callable[[Mapping[str, EngineLoad]], Plan] | None = None
    raises: bool = False
    plans: list[tuple[str, list[int], Plan]] = field(default_factory=list)
    sent: list[Plan] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)
    pulls_pinned: list[str | None] = field(default_factory=list)  # each plan's pull_from

    def __post_init__(self) -> None:
        self._inner = LoadOnlyPolicy(self.engines, self.mode)
        self.outcome_seen = asyncio.Event()

    def plan(self, request_id: str, prompt: Sequence[int], loads: Mapping[str, EngineLoad],
             now: float, *, serve_on: str | None = None,
             pull_from: str | None = None) -> Plan:
        self.pulls_pinned.append(pull_from)
        if self.raises:
            raise RuntimeError("policy bug")
        plan = self.choose(loads) if self.choose else self._inner.plan(
            request_id, prompt, loads, now, serve_on=serve_on)
        self.plans.append((request_id, list(prompt), plan))
        return plan

    def on_sent(self, request_id: str, plan: Plan, prompt: Sequence[int], now: float) -> None:
        self.sent.append(plan)

    def on_outcome(self, outcome: Outcome, now: float) -> None:
        self.outcomes.append(outcome)
        self.outcome_seen.set()

    def on_engine_restart(self, engine: str, now: float) -> None:
        self.restarts.append(engine)

    def stats(self) -> dict[str, int]:
        return {"predicted_cached_tokens": 7, "actual_cached_tokens": 5}


def prefer(first: str, then: str, **plan: Any) -> Callable[[Mapping[str, EngineLoad]], Plan]:
    """A choice: ``first`` while it is healthy, else ``then``."""

    def choose(loads: Mapping[str, EngineLoad]) -> Plan:
        return Plan(engine=first if loads[first].healthy else then, **plan)

    return choose


@dataclass
class Fleet:
    engines: dict[str, FakeEngine]
    router: Router
    policy: RecordingPolicy
    client: aiohttp.ClientSession
    journal: list[str]

    @property
    def url(self) -> str:
        return self.router.url

    async def post(self, path: str, body: Mapping[str, Any]) -> tuple[int, Any]:
        async with self.client.post(self.url + path, json=body) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text

    async def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as ``name{k=v,...}`` -> value (parsed by prometheus)."""
        async with self.client.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples


def engine_table(name: str, engine: FakeEngine, index: int, role: str = "both") -> dict[str, Any]:
    return {"name": name, "url": engine.url, "peer": f"127.0.0.{index + 1}:{5710 + index}",
            "role": role}


@asynccontextmanager
async def fleet(
    mode: str = "shared",
    roles: Mapping[str, str] | None = None,
    *,
    choose: Callable[[Mapping[str, EngineLoad]], Plan] | None = None,
    settings: Mapping[str, Any] | None = None,
    engines: Mapping[str, FakeEngine] | None = None,
) -> AsyncIterator[Fleet]:
    """Fake engines (``roles``: name -> role) behind a router with a recording policy."""
    journal: list[str] = []
    roles = roles or {"a": "both", "b": "both"}
    fakes = dict(engines) if engines else {n: FakeEngine(n, journal=journal) for n in roles}
    for fake in fakes.values():
        if not fake.port:
            await fake.start()
    config = make_config(mode, {n: (fakes[n], role) for n, role in roles.items()}, settings)
    policy = RecordingPolicy(config.specs, config.mode, choose)
    router = Router(config, policy)
    await router.start()
    client = aiohttp.ClientSession()
    try:
        yield Fleet(fakes, router, policy, client, journal)
    finally:
        await client.close()
        await router.stop()
        for fake in fakes.values():
            await fake.stop()


def make_config(mode: str, engines: Mapping[str, tuple[FakeEngine, str]],
                settings: Mapping[str, Any] | None = None) -> RouterConfig:
    tables = [engine_table(name, fake, i, role)
              for i, (name, (fake, role)) in enumerate(engines.items())]
    return from_mapping({"mode": mode, "listen": "127.0.0.1:0", "engine": tables,
                         "health_interval_s": 30, **(settings or {})})


async def read_events(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """SSE events of a streamed answer, one by one as they arrive."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event
    if buffer.strip():
        yield buffer


@dataclass
class EngineProcess:
    """A fake engine in its own process group, so a test can kill it for real."""

    process: asyncio.subprocess.Process
    url: str

    def kill(self) -> None:
        if self.process.returncode is None:
            # asyncio's child watcher may have reaped it already without telling us yet
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    async def close(self) -> None:
        self.kill()
        await self.process.wait()


async def spawn_engine() -> EngineProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvpeer.lab.engines.fakeengine", "--port", "0",
        stdout=asyncio.subprocess.PIPE, start_new_session=True, env=env,
    )
    assert process.stdout is not None
    try:
        url = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
    assert url.startswith("http://"), url
    return EngineProcess(process, url)
