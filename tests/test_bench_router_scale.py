"""``kvpeer bench router-scale`` at tiny sizes: the synthetic engines' events are what
vLLM publishes and the index follows them exactly; decisions name engines that hold."""

from __future__ import annotations

import random
from dataclasses import replace
from functools import partial

from kvpeer.lab.bench import router_scale as rs
from kvpeer.router.events import BatchDecoded, decode_batch
from kvpeer.router.feed import EventFeed
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex
from kvpeer.router.kvevents import BlocksRemoved, BlocksStored

TINY = rs.RouterScaleSpec(
    fleets=(3,), seconds=0.5, warmup_s=0.3, requests_per_s=40.0, prompt_tokens=256,
    prefix_tokens=128, system_prompts=4, block_size=16, gpu_blocks=48, cpu_blocks=96,
    decisions=90,
)


def _steps(engines: list[rs.SyntheticEngine], n: int) -> list[tuple[str, list[bytes]]]:
    rng = random.Random(5)
    workload = rs._Workload(TINY, rng)
    out = []
    for step in range(n):
        out.extend(rs._steps(engines, workload, rng, TINY.requests_per_s, step * rs.STEP_S))
    return out


def test_engines_publish_decodable_vllm_batches_with_stores_and_removals() -> None:
    engine = rs.SyntheticEngine("e0", TINY, random.Random(1))
    kinds: set[type] = set()
    for _, parts in _steps([engine], 40):
        _topic, seq, payload = parts
        assert len(seq) == 8
        decoded = decode_batch(payload)
        assert isinstance(decoded, BatchDecoded), decoded
        assert decoded.skipped == ()
        kinds.update(type(e) for e in decoded.events)
    assert {BlocksStored, BlocksRemoved} <= kinds  # the caches filled and evicted


def test_the_index_holds_exactly_what_each_engine_holds() -> None:
    engines = [rs.SyntheticEngine(f"e{i}", TINY, random.Random(i)) for i in range(3)]
    index = PrefixIndex(TINY.block_size)
    feeds = {e.name: EventFeed(can_replay=False, sink=partial(index.apply, e.name))
             for e in engines}
    for name, parts in _steps(engines, 60):
        feeds[name].on_live(parts, 0.0)
    held = {(name, medium): blocks for name, medium, blocks in index.statistics(0.0).blocks}
    for engine in engines:
        assert engine.held(MEDIUM_GPU) == TINY.gpu_blocks  # full: evictions happened
        for medium in (MEDIUM_GPU, MEDIUM_CPU):
            assert held[(engine.name, medium)] == engine.held(medium)
    assert all(f.statistics().dropped == () for f in feeds.values())


def test_a_fleet_row_indexes_every_batch_and_decides_for_holders() -> None:
    row = rs.run_fleet(TINY, 3, lambda _: None)
    assert row["events"] > 0
    assert row["batches_applied"] >= row["batches"] > 0
    assert row["batches_applied"] == row["batches_published"]  # every batch was indexed
    assert row["blocks_held"] == 3 * (TINY.gpu_blocks + TINY.cpu_blocks)
    assert row["index_bytes"] > 0
    assert row["decisions"] == TINY.decisions
    assert row["decisions_with_cache"] > 0
    assert row["decisions_naming_a_non_holder"] == 0
    assert row["second_turns_held"] > 0
    assert row["second_turns_to_holder"] > 0  # loads may send some elsewhere
    assert 0 < row["decision_p50_ms"] <= row["decision_p99_ms"]


def test_a_stale_index_is_caught_as_naming_a_non_holder() -> None:
    """The check can fail: an index that misses every removal names engines that no
    longer hold the prefix."""
    original = PrefixIndex.apply

    def apply_without_removals(self: PrefixIndex, engine: str, item: object) -> None:
        if not isinstance(item, BlocksRemoved):
            original(self, engine, item)  # type: ignore[arg-type]

    PrefixIndex.apply = apply_without_removals  # type: ignore[method-assign]
    try:
        row = rs.run_fleet(TINY, 3, lambda _: None)
    finally:
        PrefixIndex.apply = original  # type: ignore[method-assign]
    assert row["decisions_naming_a_non_holder"] > 0


def test_render_prints_one_line_per_fleet() -> None:
    result = rs.run(replace(TINY, fleets=(2, 3)), lambda _: None)
    text = rs.render(result)
    assert len(text.splitlines()) == 2 + 2 + 1
    assert "MiB/M blocks" in text


def test_the_python_baseline_runs_no_c_and_decodes_the_same() -> None:
    """``Py loops`` is what a router without the C extension runs: inside ``without_c``
    the translation and the hashing are Python's, with the same results, and the C
    ones are back after it."""
    from kvpeer.router import events as events_module
    from kvpeer.router import index as index_module
    from kvpeer.router import indexloops

    native = events_module._native_intake
    chain = index_module._chain
    engines = [rs.SyntheticEngine(f"e{i}", TINY, random.Random(i)) for i in range(3)]
    payloads = [parts[2] for _, parts in _steps(engines, 8)]
    with rs.without_c():
        assert events_module._native_intake is None
        assert index_module._chain is indexloops.chain
        in_python = [decode_batch(p) for p in payloads]
        keys = PrefixIndex(16).keys(list(range(64)))
    assert events_module._native_intake is native
    assert index_module._chain is chain
    assert [decode_batch(p) for p in payloads] == in_python
    assert PrefixIndex(16).keys(list(range(64))) == keys
