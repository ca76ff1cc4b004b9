"""Peer host names: the router names engines' tiers to each other by IP address (a tier's
identity and allow-list are by address), resolving the names an operator configured."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvpeer.config import AllowList
from kvpeer.lab.engines.fakeengine import FakeEngine
from kvpeer.router.app import Router
from kvpeer.router.config import from_mapping
from kvpeer.router.peeraddr import PeerAddresses, system_resolver
from kvpeer.router.policy import EngineSpec, Mode, Plan
from tests.router.conftest import RecordingPolicy, run


def spec(name: str, host: str, port: int = 5710) -> EngineSpec:
    return EngineSpec(name=name, url=f"http://{name}:8000", peer_host=host, peer_port=port)


class Resolver:
    """Answers from a table the test edits; records every lookup; may hang or fail."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[str] = []
        self.hang: set[str] = set()

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append(host)
        if host in self.hang:
            await asyncio.Event().wait()
        if host not in self.table:
            raise OSError(f"{host}: Name or service not known")
        return self.table[host]


def test_names_resolve_to_their_address_and_ip_literals_are_never_looked_up() -> None:
    async def scenario() -> None:
        resolver = Resolver({"engine-0.engines": ["10.244.1.5"]})
        specs = [spec("a", "engine-0.engines"), spec("b", "10.244.2.9"), spec("c", "fd00::7")]
        peers = PeerAddresses(specs, timeout_s=1.0, resolver=resolver)
        assert peers.dialable(specs[0]) is None  # before the first lookup: no address
        await peers.refresh()
        assert resolver.asked == ["engine-0.engines"]
        resolved = peers.dialable(specs[0])
        assert resolved is not None
        assert (resolved.peer_host, resolved.peer_port, resolved.name) == ("10.244.1.5", 5710, "a")
        assert peers.dialable(specs[1]) is specs[1]
        assert peers.dialable(specs[2]) is specs[2]
        assert peers.dialable(None) is None

    run(scenario())


def test_a_failed_lookup_keeps_the_last_address_and_a_new_one_replaces_it() -> None:
    async def scenario() -> None:
        resolver = Resolver({"engine-0.engines": ["10.244.1.5"]})
        engine = spec("a", "engine-0.engines")
        peers = PeerAddresses([engine], timeout_s=1.0, resolver=resolver)
        await peers.refresh()
        del resolver.table["engine-0.engines"]  # the pod is gone: its name no longer answers
        await peers.refresh()
        kept = peers.dialable(engine)
        assert kept is not None
        assert kept.peer_host == "10.244.1.5"
        resolver.table["engine-0.engines"] = ["10.244.3.8", "10.244.1.5"]  # restarted elsewhere
        await peers.refresh()
        moved = peers.dialable(engine)
        assert moved is not None
        assert moved.peer_host == "10.244.3.8"
        stats = peers.statistics()
        assert (stats.names, stats.resolved, stats.lookups) == (1, 1, 3)
        assert (stats.lookup_failures, stats.changes) == (1, 1)

    run(scenario())


def test_answers_that_are_not_addresses_are_no_address() -> None:
    async def scenario() -> None:
        resolver = Resolver({"evil.engines": ["not-an-ip", "engine-9.engines"]})
        engine = spec("a", "evil.engines")
        peers = PeerAddresses([engine], timeout_s=1.0, resolver=resolver)
        await peers.refresh()
        assert peers.dialable(engine) is None
        assert peers.statistics().lookup_failures == 1

    run(scenario())


def test_a_hung_lookup_is_bounded_and_does_not_hold_up_the_others() -> None:
    async def scenario() -> None:
        resolver = Resolver({"fast.engines": ["10.0.0.1"], "slow.engines": ["10.0.0.2"]})
        resolver.hang.add("slow.engines")
        fast, slow = spec("a", "fast.engines"), spec("b", "slow.engines")
        peers = PeerAddresses([fast, slow], timeout_s=0.2, resolver=resolver)
        async with asyncio.timeout(5.0):
            await peers.refresh()
        assert peers.dialable(slow) is None
        resolved = peers.dialable(fast)
        assert resolved is not None
        assert resolved.peer_host == "10.0.0.1"

    run(scenario())


def test_the_system_resolver_answers_addresses_for_localhost() -> None:
    answers = run(system_resolver("localhost", 5710))
    assert answers
    assert all(ipaddress.ip_address(a).is_loopback for a in answers)


def test_a_name_is_what_a_cidr_allow_list_cannot_match() -> None:
    """Why the router resolves: a tier refuses to dial a name its CIDR list cannot place."""
    pod_network = AllowList.from_entries(["10.244.0.0/16"])
    assert not pod_network.allows("engine-0.engines", 5710)
    assert pod_network.allows("10.244.1.5", 5710)


def tables(a: FakeEngine, b: FakeEngine, role_b: str = "both") -> list[dict[str, Any]]:
    return [
        {"name": "a", "url": a.url, "peer": "engine-a.engines:5710",
         "role": "decode" if role_b == "prefill" else "both"},
        {"name": "b", "url": b.url, "peer": "engine-b.engines:5711", "role": role_b},
    ]  # fmt: skip


async def routed_body(
    mode: str, plan: Plan, names: dict[str, list[str]]
) -> tuple[dict[str, Any], int]:
    """The body engine ``a`` got for one request routed by ``plan`` (peers named by DNS
    names that resolve per ``names``), and how many bodies ``b`` got."""
    a, b = FakeEngine("a"), FakeEngine("b")
    await a.start()
    await b.start()
    config = from_mapping({
        "mode": mode, "listen": "127.0.0.1:0", "health_interval_s": 30,
        "engine": tables(a, b, "prefill" if mode == "pd" else "both"),
    })  # fmt: skip
    router = Router(config, RecordingPolicy(config.specs, Mode(mode), lambda loads: plan))
    router.peers = PeerAddresses(config.specs, timeout_s=1.0, resolver=Resolver(names))
    await router.start()
    try:
        body = {"model": "fake-model", "prompt": list(range(40)), "max_tokens": 3}
        async with (
            aiohttp.ClientSession() as client,
            client.post(router.url + "/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
        (sent,) = a.generation_bodies()
        return dict(sent), len(b.generation_bodies())
    finally:
        await router.stop()
        await a.stop()
        await b.stop()


def test_the_router_names_a_source_by_its_resolved_address() -> None:
    body, _ = run(routed_body("shared", Plan(engine="a", source="b"),
                              {"engine-b.engines": ["10.244.7.7"]}))  # fmt: skip
    source = body["kv_transfer_params"]["remote_kv_source"]
    assert (source["remote_host"], source["remote_port"]) == ("10.244.7.7", 5711)


def test_a_source_whose_name_never_resolved_is_not_named() -> None:
    body, _ = run(routed_body("shared", Plan(engine="a", source="b"), {}))
    assert "kv_transfer_params" not in body  # computed locally: never a name to dial


def test_pd_names_the_prefill_engine_by_its_resolved_address() -> None:
    body, prefill_legs = run(routed_body("pd", Plan(engine="a", prefill_engine="b"),
                                         {"engine-b.engines": ["10.244.7.8"]}))  # fmt: skip
    prefiller = body["kv_transfer_params"]["remote_prefiller"]
    assert (prefiller["remote_host"], prefiller["remote_port"]) == ("10.244.7.8", 5711)
    assert prefill_legs == 1


def test_pd_with_an_unresolved_prefill_engine_runs_no_prefill_leg() -> None:
    body, prefill_legs = run(routed_body("pd", Plan(engine="a", prefill_engine="b"), {}))
    assert "kv_transfer_params" not in body  # decode-only
    assert prefill_legs == 0
