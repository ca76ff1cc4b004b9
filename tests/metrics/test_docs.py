"""docs/metrics.md's metrics table and the Grafana dashboard agree with the catalog."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvpeer.metrics.catalog import CATALOG, MetricType, markdown_table

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


def test_dashboard_is_json_and_every_expression_names_catalog_metrics() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana" / "kvpeer.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"model_name", "engine"} <= variables  # vLLM's dashboard variables
    histograms = {m.name for m in CATALOG if m.type is MetricType.HISTOGRAM}
    names = {m.name for m in CATALOG}
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            found = re.findall(r"vllm:kvpeer_([a-z_]+)", expr)
            assert found, expr
            assert "$model_name" in expr, expr
            assert "$engine" in expr, expr
            for name in found:
                base = name
                for suffix in SUFFIXES:
                    if name.endswith(suffix) and name.removesuffix(suffix) in histograms:
                        base = name.removesuffix(suffix)
                assert base in names, f"{panel['title']}: {name} is not in the catalog"
                used.add(base)
    assert {"fetches_total", "lookups_total", "pulled_bytes_total", "served_bytes_total",
            "fetch_duration_seconds", "sessions", "thread_cpu_seconds_total"} <= used  # fmt: skip
