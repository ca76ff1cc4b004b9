"""The router's metric families: declared once (kvpeer.router.metrics.FAMILIES), exported
exactly so by a router, named by Prometheus' conventions, and listed in docs/metrics.md."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry

from kvpeer.lab.engines.fakeengine import FakeEngine
from kvpeer.router.app import Router
from kvpeer.router.config import from_mapping
from kvpeer.router.generations import DiscoveringRouter
from kvpeer.router.metrics import FAMILIES, POLICY_RATES, Family, Kind, markdown_table
from tests.router.conftest import engine_table, run
from tests.router.test_discovery import FakeResolver

ROOT = Path(__file__).resolve().parents[2]


def exported(registry: CollectorRegistry) -> dict[str, tuple[str, set[frozenset[str]]]]:
    """family name -> (type, the label name sets of its value samples)."""
    out = {}
    for family in registry.collect():
        labels = {frozenset(k for k in s.labels if k != "le") for s in family.samples
                  if not s.name.endswith("_created")}  # fmt: skip
        out[family.name] = (family.type, labels)
    return out


def test_a_router_exports_exactly_the_declared_families() -> None:
    """A router with the decision core, event feeds and load scrapes, after a request
    went through it: every family it exports is declared, with its type and labels, and
    every declared family is exported."""

    async def scenario() -> dict[str, tuple[str, set[frozenset[str]]]]:
        engines = {name: FakeEngine(name) for name in ("a", "b")}
        for fake in engines.values():
            await fake.start()
        # kv_events on ports nothing listens on: the feeds exist, never synced
        tables = [{**engine_table(name, fake, i), "kv_events": f"tcp://127.0.0.1:{1 + i}"}
                  for i, (name, fake) in enumerate(engines.items())]
        config = from_mapping({"mode": "shared", "listen": "127.0.0.1:0",
                               "health_interval_s": 30, "load_scrape_interval_s": 1,
                               "engine": tables})
        router = Router(config)
        await router.start()
        try:
            body = {"model": "m", "prompt": list(range(40)), "max_tokens": 2}
            async with aiohttp.ClientSession() as client, client.post(
                    router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
            return exported(router.registry)
        finally:
            await router.stop()
            for fake in engines.values():
                await fake.stop()

    families = run(scenario())
    declared = {f.family_name: f for f in FAMILIES if not f.scope}
    assert sorted(set(families) - set(declared)) == [], "exported, not declared"
    assert sorted(set(declared) - set(families)) == [], "declared, not exported"
    for name, (kind, label_sets) in families.items():
        family = declared[name]
        assert kind == family.kind.value, name
        for labels in label_sets:
            assert labels == set(family.labels), (name, labels)


def test_a_discovering_router_exports_the_declared_discovery_families() -> None:
    async def scenario() -> dict[str, tuple[str, set[frozenset[str]]]]:
        config = from_mapping({"mode": "shared", "listen": "127.0.0.1:0",
                               "discovery": {"dns": "kvpeer-engine"}})
        router = DiscoveringRouter(config, resolver=FakeResolver())  # finds nothing
        await router.start()
        try:
            assert router.current is not None
            return exported(router.current.registry)
        finally:
            await router.stop()

    families = run(scenario())
    declared = {f.family_name: f for f in FAMILIES if f.scope == "discovery"}
    assert sorted(set(families) ^ set(declared)) == []
    for name, (kind, label_sets) in families.items():
        assert kind == declared[name].kind.value, name
        assert label_sets <= {frozenset(declared[name].labels)}, name


def test_every_family_follows_prometheus_conventions() -> None:
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))
    for family in FAMILIES:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", family.name), family.name
        assert family.name.endswith("_total") == (family.kind is Kind.COUNTER), family.name
        assert not re.search(r"_s(_|$)", family.name), f"{family.name}: seconds are _seconds"
        assert "key" not in family.labels, f"{family.name}: a label names what it holds"
        assert family.help.endswith("."), family.name
        if family.kind is Kind.HISTOGRAM:
            assert family.name.endswith(("_seconds", "_error")), family.name
    rates = {name for name, _ in POLICY_RATES.values()}
    assert rates <= set(names)


def test_docs_metrics_lists_every_router_family_as_declared() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    section = re.search(
        r"<!-- router-metrics-table:[^\n]*-->\n(.*?)\n<!-- /router-metrics-table -->", text, re.S
    )
    assert section is not None, "docs/metrics.md has no generated router metrics table"
    assert section.group(1) == markdown_table(), (
        "docs/metrics.md's router table is stale: paste kvpeer.router.metrics.markdown_table()"
    )


def test_a_family_name_is_what_prometheus_client_calls_it() -> None:
    counter = Family("x_total", Kind.COUNTER, "X.")
    gauge = Family("y_seconds", Kind.GAUGE, "Y.")
    assert counter.family_name == "kvpeer_router_x"
    assert gauge.family_name == "kvpeer_router_y_seconds"
