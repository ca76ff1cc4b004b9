"""docs/metrics.md's metrics table and the Grafana dashboard agree with the catalog and
the router's declared families."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvpeer.metrics.catalog import CATALOG, MetricType, markdown_table
from kvpeer.router.metrics import FAMILIES, Kind

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = ("_bucket", "_count", "_sum")


def test_readme_lists_every_metric_exactly_as_the_catalog() -> None:
    readme = (ROOT / "docs" / "metrics.md").read_text()
    section = re.search(
        r"<!-- metrics-table:[^\n]*-->\n(.*?)\n<!-- /metrics-table -->", readme, re.S
    )
    assert section is not None, "docs/metrics.md has no generated metrics table"
    assert section.group(1) == markdown_table(), (
        "docs/metrics.md's metrics table is stale: paste kvpeer.metrics.catalog.markdown_table()"
    )


def test_dashboard_is_json_and_every_expression_names_exported_metrics() -> None:
    """Every query names families the tier (the catalog, as vLLM's ``vllm:kvpeer_*``) or
    the router (``kvpeer.router.metrics.FAMILIES``) exports, and is scoped by the
    dashboard's pod-level variables (vLLM's ``engine`` label is an engine index, "0" on
    every pod: useless to choose a pod by)."""
    dashboard = json.loads((ROOT / "docs" / "grafana" / "kvpeer.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"model_name", "pod", "router"} <= variables
    assert "engine" not in variables
    histograms = {m.name for m in CATALOG if m.type is MetricType.HISTOGRAM}
    names = {m.name for m in CATALOG}
    router_histograms = {f.name for f in FAMILIES if f.kind is Kind.HISTOGRAM}
    router_names = {f.name for f in FAMILIES}
    used: set[str] = set()
    used_router: set[str] = set()
    rows = [panel for panel in dashboard["panels"] if panel["type"] == "row"]
    assert [row["title"] for row in rows] == ["Router (kvpeer router)"]
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            tier = re.findall(r"vllm:kvpeer_([a-z_]+)", expr)
            router = re.findall(r"kvpeer_router_([a-z_]+)", expr)
            assert bool(tier) != bool(router), expr  # one side per query
            if tier:
                assert "$model_name" in expr, expr
                assert 'pod=~"$pod"' in expr, expr
                used |= {_base(name, histograms, names, panel["title"]) for name in tier}
            else:
                assert 'pod=~"$router"' in expr, expr
                used_router |= {_base(name, router_histograms, router_names, panel["title"])
                                for name in router}
    assert {"fetches_total", "lookups_total", "pulled_bytes_total", "served_bytes_total",
            "fetch_duration_seconds", "sessions", "thread_cpu_seconds_total"} <= used  # fmt: skip
    # the router row: plans by reason, pulls, prefetches, feed health per engine, TTFT
    assert {"policy_plans_by_reason_total", "policy_pulls_planned_total", "prefetches_total",
            "feed_synced", "feed_gaps_total", "feed_dropped_total",
            "ttft_seconds"} <= used_router  # fmt: skip


def _base(name: str, histograms: set[str], names: set[str], title: str) -> str:
    """``name`` without a histogram's sample suffix; it must be an exported family."""
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in histograms:
            name = name.removesuffix(suffix)
    assert name in names, f"{title}: {name} is not exported"
    return name
