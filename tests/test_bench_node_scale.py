"""``kvpeer bench node-scale`` at a tiny size: a real ``kvpeer serve`` node, real peer
sessions; every session live by the node's own gauge and every lookup answered."""

from __future__ import annotations

import pytest

from kvpeer.lab.bench import node_scale as ns
from kvpeer.lab.bench.idle import LookupTiming


def test_a_few_peers_are_all_live_and_every_lookup_is_answered_with_hits() -> None:
    spec = ns.NodeScaleSpec(peers=3, idle_s=0.3, rounds=2, blocks=4)
    result = ns.run(spec, lambda _: None)
    assert result["sessions_live"] == 3
    assert result["sessions_live_after"] == 3
    assert result["opening"]["answered"] == result["opening"]["all_hits"] == 3
    alone, together = result["lookups"]
    assert alone["lookups"] == alone["answered"] == alone["all_hits"] == 2
    assert together["lookups"] == together["answered"] == together["all_hits"] == 6
    assert result["idle"]["hub_rss_n"] > 0
    text = ns.render(result)
    assert "3 peers at once" in text


def test_an_unanswered_or_partial_lookup_is_counted_as_such() -> None:
    row = ns.latency_row("x", [LookupTiming(0.002, 4), LookupTiming(None, 0),
                               LookupTiming(0.004, 1), None], blocks=4)
    assert row["lookups"] == 4
    assert row["answered"] == 2
    assert row["all_hits"] == 1
    assert row["max_ms"] == pytest.approx(4.0)


def test_more_peers_than_max_peers_allows_are_refused() -> None:
    with pytest.raises(ValueError, match="max_peers"):
        ns.NodeScaleSpec(peers=128)
