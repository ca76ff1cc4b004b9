"""``kvpeer stats``: one screen of a live node, from its Prometheus metrics.

Reads ``kvpeer_*`` (a standalone node) or ``vllm:kvpeer_*`` (vLLM's ``/metrics``;
vLLM's own labels, e.g. several engines, are summed), then the node's ``/peers``
(:mod:`kvpeer.metrics.peers`) when it has one.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from kvpeer.metrics import peers
from kvpeer.metrics.catalog import (
    CLOSE_KINDS,
    INFO,
    LOOKUP_RESULTS,
    PROTOCOL_ERROR_REASONS,
    TIMEOUT_KINDS,
)

__all__ = ["fetch", "metrics_url", "peers_section", "render"]

PREFIXES = ("vllm:kvpeer_", "kvpeer_")
#: The catalog's labels; any other label (vLLM's model_name, engine) is summed over.
OURS = {"result", "event", "kind", "reason", "le", "version", "protocol", "data_planes"}

Table = dict[str, dict[tuple[tuple[str, str], ...], float]]


def metrics_url(target: str) -> str:
    """``HOST:PORT`` or a URL -> the URL of its ``/metrics``."""
    if "://" in target:
        return target
    return f"http://{target}/metrics"


def fetch(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


def _table(text: str) -> Table:
    table: Table = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for prefix in PREFIXES:
                if sample.name.startswith(prefix):
                    name = sample.name.removeprefix(prefix)
                    labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k in OURS))
                    table[name][labels] += sample.value
                    break
    return table


def _get(table: Table, name: str, **labels: str) -> float:
    return table.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _breakdown(table: Table, name: str, label: str, keys: tuple[str, ...]) -> str:
    parts = [f"{k}={_get(table, name, **{label: k}):g}" for k in keys]
    nonzero = [p for p in parts if not p.endswith("=0")]
    return " ".join(nonzero) or "none"


def _mean(table: Table, name: str) -> str:
    count, total = _get(table, name + "_count"), _get(table, name + "_sum")
    return f"{count:g} (mean {total / count * 1000:.1f} ms)" if count else "0"


def render(text: str, source: str = "") -> str:
    """The one-screen view of the metrics in ``text``."""
    t = _table(text)
    if not t:
        return f"no kvpeer metrics at {source or 'that address'}"
    info = next(iter(t.get(INFO, {})), ())
    described = peers.safe(", ".join(f"{k} {v}" for k, v in info) or "unknown version", 120)
    fetched = _get(t, "fetches_total", result="ok")
    lookups = {r: _get(t, "lookups_total", result=r) for r in LOOKUP_RESULTS}
    answered = lookups["hit"] + lookups["miss"]
    ratio = f"{lookups['hit'] / answered:.1%}" if answered else "-"
    lines = [
        f"kvpeer node {source} ({described})",
        "",
        f"sessions          {_get(t, 'sessions'):g} open; "
        + _breakdown(t, "session_events_total", "event", ("opened", "closed", "refused")),
        f"  closed by kind  {_breakdown(t, 'sessions_closed_total', 'kind', CLOSE_KINDS)}",
        f"in flight         loads {_get(t, 'loads_in_flight'):g}, "
        f"transfers {_get(t, 'transfers_in_flight'):g}, pinned blocks "
        f"{_get(t, 'pinned_blocks'):g}, parked stores {_get(t, 'parked_stores'):g}, "
        f"tombstones {_get(t, 'tombstones'):g}",
        f"lookups           {_breakdown(t, 'lookups_total', 'result', LOOKUP_RESULTS)} "
        f"(hit ratio {ratio}); answered {_mean(t, 'lookup_duration_seconds')}",
        f"fetches           ok {fetched:g}, failed {_get(t, 'fetches_total', result='failed'):g};"
        f" {_mean(t, 'fetch_duration_seconds')}",
        f"pulled            {_get(t, 'pulled_blocks_total'):g} blocks, "
        f"{_size(_get(t, 'pulled_bytes_total'))}",
        f"served            {_get(t, 'served_blocks_total'):g} blocks, "
        f"{_size(_get(t, 'served_bytes_total'))}",
        f"timeouts          {_breakdown(t, 'timeouts_total', 'kind', TIMEOUT_KINDS)}",
        f"protocol errors   "
        f"{_breakdown(t, 'protocol_errors_total', 'reason', PROTOCOL_ERROR_REASONS)}",
        f"late fetches      {_get(t, 'late_fetches_rejected_total'):g} rejected; "
        f"{_get(t, 'unbound_stores_reaped_total'):g} unbound stores reaped",
        f"idle wake-ups     {_get(t, 'idle_wakeups_total'):g}; kvpeer threads' CPU "
        f"{_get(t, 'thread_cpu_seconds_total'):.2f} s",
    ]
    return "\n".join(lines)


def peers_section(metrics_url: str) -> str:
    """The per-peer table from the ``/peers`` next to ``metrics_url``, or why there is none."""
    url = peers.peers_url(metrics_url)
    try:
        document = peers.fetch_peers(url)
    except peers.PeersUnavailable as exc:
        return (
            f"peers             no per-peer view here ({peers.safe(exc, 120)}); "
            "kvpeer serve --metrics-port has one"
        )
    except OSError as exc:
        return f"peers             cannot read {peers.safe(url, 120)}: {peers.safe(exc, 120)}"
    return peers.render(document)
