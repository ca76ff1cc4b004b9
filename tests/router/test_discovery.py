"""Engine discovery: membership from observations, DNS and Kubernetes sources, and a router
whose engines join, leave and flap without a restart (a fake Kubernetes API server and
fake engines on loopback, real HTTP between them)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpeer.errors import ConfigError
from kvpeer.lab.engines.fakeengine import Behaviour, FakeEngine
from kvpeer.router.config import from_mapping
from kvpeer.router.discovery import (
    DiscoveryConfig,
    DiscoveryFailed,
    DiscoveryLoop,
    DnsSource,
    Found,
    KubernetesSource,
    Membership,
    engine_table,
)
from kvpeer.router.generations import DiscoveringRouter

from .conftest import read_events, run, until

# -- membership (sans-IO) -----------------------------------------------------------------

A, B, C = Found("a", "10.0.0.1"), Found("b", "10.0.0.2"), Found("c", "10.0.0.3")


def names(membership: Membership) -> list[str]:
    return [f.name for f in membership.members]


def test_engines_join_at_once_and_leave_only_after_the_grace() -> None:
    members = Membership(leave_after_s=30)
    assert members.observe([A, B], now=0)
    assert names(members) == ["a", "b"]
    assert not members.observe([A, B], now=5)
    assert not members.observe([A], now=10)  # b missing for 5 s: still a member
    assert names(members) == ["a", "b"]
    assert not members.observe([A], now=34.9)
    assert members.observe([A], now=35)  # 30 s since b was last seen
    assert names(members) == ["a"]
    assert members.observe([A, C], now=36)
    stats = members.statistics()
    assert (stats.engines, stats.joined, stats.left, stats.moved) == (2, 3, 1, 0)


def test_a_flapping_engine_keeps_its_place() -> None:
    members = Membership(leave_after_s=10)
    members.observe([A, B], now=0)
    changes = [members.observe([A] if step % 2 else [A, B], now=step * 4.0)
               for step in range(1, 20)]  # fmt: skip
    assert not any(changes)  # never 10 s without b
    assert names(members) == ["a", "b"]


def test_a_failed_observation_changes_nothing_however_long() -> None:
    members = Membership(leave_after_s=10)
    members.observe([A, B], now=0)
    for now in (5.0, 50.0, 500.0):
        assert not members.observe(None, now)
    assert names(members) == ["a", "b"]
    assert members.statistics().failures == 3
    # The first good observation after the outage decides.
    assert members.observe([A], now=501)
    assert names(members) == ["a"]


def test_an_engine_at_a_new_address_moves_at_once_and_duplicates_are_ignored() -> None:
    members = Membership(leave_after_s=30)
    members.observe([A], now=0)
    assert members.observe([Found("a", "10.0.0.9"), Found("a", "10.0.0.8")], now=1)
    assert members.members == (Found("a", "10.0.0.9"),)
    assert members.statistics().moved == 1


# -- DNS ----------------------------------------------------------------------------------


@dataclass
class FakeResolver:
    """Answers from dicts; a name missing from both raises as a failed lookup does."""

    a: dict[str, list[str]] = field(default_factory=dict)
    srv: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    lookups: list[str] = field(default_factory=list)

    async def addresses(self, name: str) -> list[str]:
        self.lookups.append(name)
        if name not in self.a:
            raise OSError(f"{name}: Name or service not known")
        return self.a[name]

    async def services(self, name: str) -> list[tuple[str, int]]:
        self.lookups.append(name)
        if name not in self.srv:
            raise OSError(f"{name}: NXDOMAIN")
        return self.srv[name]


def test_a_headless_services_a_records_are_engines_named_by_address() -> None:
    resolver = FakeResolver(a={"kvpeer-engine": ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::7"],
                               "v6-only": ["fd00::7", "fd00::8"]})  # fmt: skip
    source = DnsSource("kvpeer-engine", resolver)
    found = run(source.observe())
    # Dual stack: the pods' IPv4 addresses only (fd00::7 is one of them again).
    assert found == [Found("10.0.0.2", "10.0.0.2"), Found("10.0.0.1", "10.0.0.1")]
    found = run(DnsSource("v6-only", resolver).observe())
    assert found == [Found("fd00::7", "fd00::7"), Found("fd00::8", "fd00::8")]
    config = DiscoveryConfig.from_mapping({"dns": "kvpeer-engine"})
    assert engine_table(config, found[0]) == {
        "name": "fd00::7", "url": "http://[fd00::7]:8000", "peer": "[fd00::7]:5710",
        "kv_events": "tcp://[fd00::7]:5557", "kv_events_replay": "tcp://[fd00::7]:5558",
    }  # fmt: skip


def test_srv_records_name_engines_by_their_pod_and_give_the_port() -> None:
    name = "_http._tcp.kvpeer-engine.ns.svc.cluster.local"
    resolver = FakeResolver(srv={name: [
        ("kvpeer-engine-0.kvpeer-engine.ns.svc.cluster.local.", 8000),
        ("kvpeer-engine-1.kvpeer-engine.ns.svc.cluster.local.", 8001),
        ("bad name with spaces.", 8000),  # hostile: skipped and counted
        ("kvpeer-engine-2.kvpeer-engine.ns.svc.cluster.local.", 0),
    ]})  # fmt: skip
    source = DnsSource(name, resolver, srv=True)
    found = run(source.observe())
    assert [(f.name, f.port) for f in found] == [("kvpeer-engine-0", 8000),
                                                ("kvpeer-engine-1", 8001)]  # fmt: skip
    assert found[0].host == "kvpeer-engine-0.kvpeer-engine.ns.svc.cluster.local"
    assert source.skipped == 2


def test_a_failed_lookup_is_a_failed_observation_not_an_empty_fleet() -> None:
    source = DnsSource("gone", FakeResolver())
    with pytest.raises(DiscoveryFailed, match="gone: Name or service not known"):
        run(source.observe())


def test_the_loop_reports_each_change_a_resolver_shows_and_nothing_else() -> None:
    """Added, removed, flapping and failing, as a headless Service's A records show them."""

    async def scenario() -> None:
        resolver = FakeResolver(a={"svc": ["10.0.0.1"]})
        clock = Clock()
        reported: list[list[str]] = []

        async def changed(members: tuple[Found, ...]) -> None:
            reported.append([m.name for m in members])

        loop = DiscoveryLoop(DnsSource("svc", resolver), Membership(leave_after_s=10), changed,
                             interval_s=3600, clock=clock)  # fmt: skip
        script: list[tuple[float, list[str] | None]] = [
            (0, ["10.0.0.1"]),  # the first engine
            (1, ["10.0.0.1", "10.0.0.2"]),  # added
            (2, ["10.0.0.1"]), (5, ["10.0.0.1", "10.0.0.2"]),  # flaps: within 10 s
            (6, None), (30, None),  # the lookup fails: nothing changes
            (31, ["10.0.0.1"]),  # removed: not seen since 5 s
            (32, ["10.0.0.1"]),
        ]
        for now, addresses in script:
            clock.now = now
            if addresses is None:
                resolver.a.pop("svc", None)
            else:
                resolver.a["svc"] = addresses
            await loop.observe_once()
        assert reported == [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"], ["10.0.0.1"]]
        assert loop.membership.statistics().failures == 2

    run(scenario())


# -- a fake Kubernetes API server ---------------------------------------------------------


@dataclass
class FakeKubernetes:
    """The EndpointSlice list of one namespace, filtered by an equality label selector, as
    the API server serves it; a bearer token is required."""

    token: str = "sa-token"
    slices: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    requests: list[Mapping[str, str]] = field(default_factory=list)
    url: str = ""

    async def list_slices(self, request: web.Request) -> web.Response:
        self.requests.append(dict(request.query))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if self.status != 200:
            return web.json_response({"kind": "Status", "code": self.status}, status=self.status)
        wanted = dict(part.split("=", 1) for part in
                      request.query.get("labelSelector", "").split(",") if part)  # fmt: skip
        items = [s for s in self.slices
                 if request.match_info["namespace"] == s["metadata"]["namespace"]
                 and wanted.items() <= s["metadata"]["labels"].items()]  # fmt: skip
        return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                  "items": items})  # fmt: skip

    def publish(self, engines: Mapping[str, tuple[str, int]], *, terminating: str = "") -> None:
        """One slice per engine (its own HTTP port), labelled as the Service's."""
        self.slices = [{
            "metadata": {"name": f"kvpeer-engine-{name}", "namespace": "fleet",
                         "labels": {"kubernetes.io/service-name": "kvpeer-engine",
                                    "app.kubernetes.io/component": "engine"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": port, "protocol": "TCP"},
                      {"name": "kvpeer", "port": 5710, "protocol": "TCP"}],
            "endpoints": [{"addresses": [host],
                           "conditions": {"ready": True, "terminating": name == terminating},
                           "targetRef": {"kind": "Pod", "name": name, "namespace": "fleet"}}],
        } for name, (host, port) in engines.items()]  # fmt: skip


@asynccontextmanager
async def kubernetes_api() -> AsyncIterator[FakeKubernetes]:
    api = FakeKubernetes()
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                       api.list_slices)  # fmt: skip
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    api.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield api
    finally:
        await runner.cleanup()


def service_account(tmp_path: Path, token: str = "sa-token") -> Path:
    folder = tmp_path / "serviceaccount"
    folder.mkdir(exist_ok=True)
    (folder / "token").write_text(token + "\n")
    (folder / "namespace").write_text("fleet")
    return folder


def test_the_kubernetes_source_lists_endpoint_slices_by_label_selector(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with kubernetes_api() as api, aiohttp.ClientSession() as session:
            api.publish({"kvpeer-engine-0": ("10.244.1.5", 8000),
                         "kvpeer-engine-1": ("10.244.2.9", 8000),
                         "kvpeer-engine-2": ("10.244.3.3", 8000)},
                        terminating="kvpeer-engine-2")  # fmt: skip
            account = service_account(tmp_path)
            source = KubernetesSource(api.url, "fleet", "app.kubernetes.io/component=engine",
                                      lambda: session, token_file=account / "token")  # fmt: skip
            found = await source.observe()
            assert found == [Found("kvpeer-engine-0", "10.244.1.5", 8000),
                             Found("kvpeer-engine-1", "10.244.2.9", 8000)]  # fmt: skip
            assert api.requests[-1] == {"labelSelector": "app.kubernetes.io/component=engine"}
            # Another selector selects nothing; a refusal is a failure, not an empty fleet.
            other = KubernetesSource(api.url, "fleet", "app=other", lambda: session,
                                     token_file=account / "token")  # fmt: skip
            assert await other.observe() == []
            # Dual stack: the IPv6 slice (listed first here) names the same pods; each
            # stays at its IPv4 address.
            v6 = [{**s, "addressType": "IPv6",
                   "endpoints": [{**s["endpoints"][0], "addresses": ["fd00::1"]}]}
                  for s in api.slices]  # fmt: skip
            api.slices = v6 + api.slices
            assert [f.host for f in await source.observe()] == ["10.244.1.5", "10.244.2.9"]
            api.slices = api.slices[len(v6):]
            api.token = "rotated"
            with pytest.raises(DiscoveryFailed, match="HTTP 401"):
                await source.observe()
            (account / "token").write_text("rotated")  # read again at every call
            assert len(await source.observe()) == 2

    run(scenario())


def test_a_hostile_api_answer_is_refused_or_skipped(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with kubernetes_api() as api, aiohttp.ClientSession() as session:
            source = KubernetesSource(api.url, "fleet", "", lambda: session, token_file=None)
            api.token = "t"
            api.slices = [{"metadata": {"namespace": "fleet", "labels": {}},
                           "ports": [{"name": "http", "port": "80; rm -rf"}],
                           "endpoints": [{"addresses": ["not an address"]}, "junk",
                                         {"addresses": ["10.0.0.1"],
                                          "targetRef": {"name": "a,b=c"}},
                                         {"addresses": ["10.0.0.2"], "hostname": "ok"}]}]
            with pytest.raises(DiscoveryFailed, match="HTTP 401"):  # no token sent
                await source.observe()
            source.token_file = service_account(tmp_path, "t") / "token"
            found = await source.observe()
            assert found == []  # every endpoint has the bad port, or a bad name or address
            api.slices[0]["ports"] = [{"name": "http", "port": 8000}]
            assert await source.observe() == [Found("ok", "10.0.0.2", 8000)]
            assert source.skipped == 4 + 3  # all four, then all but "ok"

    run(scenario())


# -- configuration ------------------------------------------------------------------------


def test_a_discovery_table_is_checked_with_every_problem_named() -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping({"discovery": {"dns": "x", "kubernetes": "a=b", "intervl_s": 1,
                                    "port": 70000, "engine": {"url": "http://x"}}})  # fmt: skip
    text = str(caught.value)
    assert "unknown key 'intervl_s' (did you mean 'interval_s'?)" in text
    assert "give exactly one source" in text
    assert "port: 70000 is out of range" in text
    assert "come from what is discovered" in text
    with pytest.raises(ConfigError, match="role 'chief'"):
        from_mapping({"discovery": {"dns": "x", "engine": {"role": "chief"}}})
    config = from_mapping({"discovery": {"srv": "_http._tcp.e", "engine": {"role": "both"}}})
    assert config.engines == ()
    assert config.discovery is not None
    assert config.discovery.source == "srv"
    with pytest.raises(ConfigError, match="no engines"):
        from_mapping({})


# -- a router following the fake API --------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def pinned(client: aiohttp.ClientSession, url: str, engine: str) -> int:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
    async with client.post(f"{url}/v1/completions", json=body,
                           headers={"X-Kvpeer-Engine": engine}) as response:  # fmt: skip
        await response.read()
        return response.status


def test_engines_join_leave_and_flap_without_a_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        fakes = {name: FakeEngine(name) for name in ("e0", "e1")}
        for index, fake in enumerate(fakes.values()):
            await fake.start(host=f"127.0.0.{index + 2}")
        published = {name: (f"127.0.0.{i + 2}", fake.port)
                     for i, (name, fake) in enumerate(fakes.items())}  # fmt: skip
        # A connection per request: a keep-alive connection to a generation that retires
        # is closed under it (generations.py says why clients retry that).
        connector = aiohttp.TCPConnector(force_close=True)
        async with kubernetes_api() as api, aiohttp.ClientSession(connector=connector) as client:
            api.publish({"e0": published["e0"]})
            config = from_mapping({
                "listen": "127.0.0.1:0", "policy": "load", "allow_pinning": True,
                "health_interval_s": 30, "drain_timeout_s": 10,
                "discovery": {"kubernetes": "app.kubernetes.io/component=engine",
                              "api": api.url, "interval_s": 3600, "leave_after_s": 30,
                              "kv_events_port": 0},
            })  # fmt: skip
            clock = Clock()
            router = DiscoveringRouter(config, service_account=service_account(tmp_path),
                                       clock=clock)  # fmt: skip
            url = await router.start()
            try:
                assert router.generations == 1
                assert await pinned(client, url, "e0") == 200
                assert await pinned(client, url, "e1") == 400  # not an engine (yet)

                # e1 joins while a stream is in flight on e0: the stream ends whole on the
                # generation that started it; the next request reaches e1.
                fakes["e0"].behaviour = Behaviour(hold_last=True)
                body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True}
                async with client.post(f"{url}/v1/completions", json=body,
                                       headers={"X-Kvpeer-Engine": "e0"}) as stream:
                    await asyncio.wait_for(fakes["e0"].stream_started.wait(), 10)
                    api.publish(published)
                    clock.now = 1
                    assert await router.loop.observe_once()
                    assert router.generations == 2
                    assert await pinned(client, url, "e1") == 200
                    fakes["e0"].release_last.set()
                    events = [e async for e in read_events(stream)]
                    assert stream.status == 200
                    assert events[-1] == b"data: [DONE]"
                fakes["e0"].behaviour = Behaviour()

                # e1 flaps out of the slices and back within leave_after_s: no new
                # generation, and it is served throughout.
                for step in range(2, 8):
                    api.publish(published if step % 2 else {"e0": published["e0"]})
                    clock.now = step * 5
                    assert not await router.loop.observe_once()
                assert router.generations == 2
                assert await pinned(client, url, "e1") == 200

                # An API outage changes nothing.
                api.status = 500
                clock.now = 1000
                assert not await router.loop.observe_once()
                assert await pinned(client, url, "e1") == 200
                api.status = 200

                # e1 leaves for good: last seen at 35 s (the outage saw nothing), so at
                # 1000 s it has been gone longer than leave_after_s and leaves at once.
                api.publish({"e0": published["e0"]})
                assert await router.loop.observe_once()
                stats = router.membership.statistics()
                assert [f.name for f in router.membership.members] == ["e0"]
                assert router.generations == 3
                assert (stats.joined, stats.left) == (2, 1)
                assert await pinned(client, url, "e1") == 400
                assert await pinned(client, url, "e0") == 200
                async with client.get(f"{url}/metrics") as response:
                    page = await response.text()
                assert "kvpeer_router_discovery_engines 1.0" in page
                assert 'kvpeer_router_discovery_changes_total{change="left"} 1.0' in page
            finally:
                await router.stop()
        for fake in fakes.values():
            await fake.stop()

    run(scenario(), timeout=60)


def test_a_router_with_nothing_discovered_is_alive_but_not_ready(tmp_path: Path) -> None:
    async def scenario() -> None:
        connector = aiohttp.TCPConnector(force_close=True)
        async with kubernetes_api() as api, aiohttp.ClientSession(connector=connector) as client:
            fake = FakeEngine("late")
            await fake.start(host="127.0.0.5")
            config = from_mapping({
                "listen": "127.0.0.1:0", "policy": "load", "health_interval_s": 30,
                "discovery": {"kubernetes": "app.kubernetes.io/component=engine",
                              "api": api.url, "interval_s": 3600, "kv_events_port": 0},
            })  # fmt: skip
            router = DiscoveringRouter(config, service_account=service_account(tmp_path))
            url = await router.start()
            try:
                async with client.get(f"{url}/health") as response:
                    assert response.status == 503
                    assert (await response.json())["status"] == "no engine discovered yet"
                async with client.get(f"{url}/metrics") as response:
                    assert response.status == 200
                    assert "kvpeer_router_discovery_engines 0.0" in await response.text()
                api.publish({"late": ("127.0.0.5", fake.port)})
                assert await router.loop.observe_once()
                async with client.get(f"{url}/health") as response:
                    assert response.status == 200
                    assert json.loads(await response.text())["up"] == ["late"]
            finally:
                await router.stop()
                await fake.stop()

    run(scenario())


def test_kvpeer_routers_serve_follows_the_systems_dns(tmp_path: Path) -> None:
    """The process path (``kvpeer router --config`` with ``[discovery]``): the system's
    resolver, a ready file, a clean stop."""
    from kvpeer.router.server import serve

    async def scenario() -> None:
        fake = FakeEngine("local")
        await fake.start(host="127.0.0.1")
        config = from_mapping({
            "listen": "127.0.0.1:0", "policy": "load", "health_interval_s": 30,
            "discovery": {"dns": "localhost", "port": fake.port, "kv_events_port": 0},
        })  # fmt: skip
        stop = asyncio.Event()
        ready = tmp_path / "ready"
        task = asyncio.create_task(serve(config, ready_file=ready, stop=stop))
        try:
            await until(lambda: ready.exists() or task.done(), "the ready file")
            assert not task.done(), task
            url = ready.read_text()
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as client:
                async with client.get(f"{url}/health") as response:
                    assert response.status == 200
                    assert "127.0.0.1" in (await response.json())["up"]
                body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
                async with client.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 200
                    assert response.headers["X-Kvpeer-Engine"] == "127.0.0.1"
        finally:
            stop.set()
            await task
            await fake.stop()

    run(scenario())


def test_a_discovered_set_that_makes_no_valid_config_keeps_the_running_generation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Invariant 3: a static engine and a discovered one on the same tier address are no
    valid config; nothing starts for that set, and the error is logged once."""

    async def scenario() -> None:
        resolver = FakeResolver(a={"svc": ["127.0.0.9"]})
        config = from_mapping({
            "listen": "127.0.0.1:0", "policy": "load", "health_interval_s": 30,
            "engine": [{"name": "static", "url": "http://127.0.0.9:1", "peer": "127.0.0.9:5710"}],
            "discovery": {"dns": "svc", "interval_s": 3600, "leave_after_s": 0.001,
                          "kv_events_port": 0},
        })  # fmt: skip
        clock = Clock()
        router = DiscoveringRouter(config, resolver=resolver, clock=clock)
        url = await router.start()
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with aiohttp.ClientSession(connector=connector) as client:
                async with client.get(f"{url}/health") as response:
                    assert response.status == 503
                    assert "not usable" in (await response.json())["status"]
                resolver.a["svc"] = ["127.0.0.8"]  # a valid set: a generation with both
                clock.now = 1
                assert await router.loop.observe_once()
                assert router.router is not None
                assert [e.name for e in router.router.config.engines] == ["static", "127.0.0.8"]
                assert router.generations == 2
                # Invalid again (the same clash, then with one more engine): the running
                # generation stays, and the same error is not logged again.
                resolver.a["svc"] = ["127.0.0.9"]
                clock.now = 2
                assert await router.loop.observe_once()
                resolver.a["svc"] = ["127.0.0.9", "127.0.0.7"]
                clock.now = 3
                assert await router.loop.observe_once()
                assert router.generations == 2
                assert [e.name for e in router.router.config.engines] == ["static", "127.0.0.8"]
                async with client.get(f"{url}/health") as response:
                    assert set((await response.json())["down"]) == {"static", "127.0.0.8"}
        finally:
            await router.stop()

    with caplog.at_level("ERROR", logger="kvpeer.router.generations"):
        run(scenario())
    refusals = [r for r in caplog.records if "no valid router config" in r.getMessage()]
    assert len(refusals) == 2  # at start, and once when it came back (not again at 3)
