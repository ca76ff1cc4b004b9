"""Held blocks in the simulation: served for real, and every held check can fail.

Worlds with held blocks (kvpeer.lab.sim.held) serve peers from them; a copy that
keeps the wrong slot, reuses a pinned row, leaks a pin, outgrows its bound or
hands a held slot to a peer whose plane cannot read it is reported; a world
without held blocks is the world it was before they were modelled; a CLI run
whose held blocks never served anybody fails its self-check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest

from kvpeer.host import BlockPool
from kvpeer.lab.sim import SeedResult, run_seed
from kvpeer.lab.sim import seeds as cli
from kvpeer.lab.sim.held import HeldProfile, WatchedHeld, draw_held
from kvpeer.lab.sim.timeouts import SimContext
from kvpeer.lab.sim.world import HeldCounts
from kvpeer.node.held import HeldBlocks
from kvpeer.types import Key

SEEDS = range(40)


def held_counts(result: SeedResult) -> HeldCounts:
    assert result.held is not None
    return result.held


@pytest.fixture(scope="module")
def serving_seed() -> int:
    """A seed whose world, held blocks forced, runs clean and writes peers blocks from
    them (the negative controls plant their defect there)."""
    for seed in SEEDS:
        result = run_seed(seed, held=True)
        if not (result.violations or result.deaths) and held_counts(result).written >= 3:
            return seed
    raise AssertionError(f"no seed of {SEEDS} served clean from held blocks")


def found(held_type: type[WatchedHeld], seeds: Sequence[int], text: str) -> list[str]:
    """Violations containing ``text`` in the first of ``seeds`` whose world (held blocks
    forced, kept in ``held_type``) reports one."""
    for seed in seeds:
        hits = [v for v in run_seed(seed, held=True, held_type=held_type).violations if text in v]
        if hits:
            return hits
    return []


class WrongSlot(WatchedHeld):
    """Copies the primary slot after the one the store job named."""

    def keep(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        super().keep(keys, [(slot + 1) % self.first_slot for slot in slots])


class ReusesPinnedRows(WatchedHeld):
    """Makes room by releasing the least recently used row, pinned or not."""

    def _take_row(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, row in self._lru.items():
            del self._lru[key]
            self._key_of[row] = None
            self._released += 1
            return row
        return None


class LeaksPins(WatchedHeld):
    """Pins every row it serves twice: one pin outlives the peer's round."""

    def pin(self, peer_id: str, keys: Sequence[Key]) -> list[int] | None:
        slots = super().pin(peer_id, keys)
        if slots is not None:
            HeldBlocks.pin(self, peer_id, keys)  # past the watcher, as a buggy tier would
        return slots


class Oversized(WatchedHeld):
    """Allocates two rows more than its ``held_bytes`` allow."""

    def __init__(self, pool: BlockPool, profile: HeldProfile, ctx: SimContext, where: str) -> None:
        more = replace(profile, held_bytes=profile.held_bytes + 2 * pool.block_len)
        super().__init__(pool, more, ctx, where)
        self.bound = profile.held_bytes


class ServesEveryPeer(WatchedHeld):
    """Hands held slots to every peer, whatever plane it writes with."""

    def __init__(self, pool: BlockPool, profile: HeldProfile, ctx: SimContext, where: str) -> None:
        super().__init__(pool, replace(profile, unserved=frozenset()), ctx, where)
        self.serves_peer = profile.serves


class TestServed:
    def test_held_worlds_serve_peers_from_held_blocks(self) -> None:
        results = [run_seed(seed, held=True) for seed in range(12)]
        assert [r.violations for r in results] == [()] * len(results)
        counts = sum((held_counts(r) for r in results), HeldCounts())
        assert counts.served > 0
        assert counts.written > 0
        assert counts.released > 0
        assert sum(held_counts(r).written > 0 for r in results) >= 9

    def test_half_of_the_worlds_draw_held_blocks(self) -> None:
        peers = ["n0:5710", "n1:5710", "n2:5710"]
        drawn = [draw_held(seed, peers, 64) for seed in range(200)]
        assert 70 < sum(bool(d) for d in drawn) < 130
        assert any(p.unserved for d in drawn for p in d.values())
        assert draw_held(1, peers, 64, always=True)

    def test_a_world_without_held_blocks_is_unchanged(self) -> None:
        peers = ["n0:5710", "n1:5710", "n2:5710"]
        seed = next(s for s in range(20) if not draw_held(s, peers, 64))
        drawn = run_seed(seed)
        assert drawn.held is None
        assert drawn == run_seed(seed, held=False)


class TestNegativeControls:
    """Each held check reports the defect it is for."""

    def test_a_copy_of_the_wrong_slot(self, serving_seed: int) -> None:
        violations = run_seed(serving_seed, held=True, held_type=WrongSlot).violations
        assert any("does not hold that key's bytes" in v for v in violations), violations
        assert any("does not hold the producer's bytes" in v for v in violations), violations

    def test_a_pinned_row_reused(self, serving_seed: int) -> None:
        seeds = [serving_seed, *SEEDS]
        hits = found(ReusesPinnedRows, seeds, "was overwritten while pinned")
        assert hits

    def test_a_leaked_pin(self, serving_seed: int) -> None:
        violations = run_seed(serving_seed, held=True, held_type=LeaksPins).violations
        assert any("held blocks count" in v for v in violations), violations
        assert any("after the quiet phase: pinned held rows" in v for v in violations), violations

    def test_more_held_bytes_than_the_bound(self, serving_seed: int) -> None:
        violations = run_seed(serving_seed, held=True, held_type=Oversized).violations
        assert any("over their held_bytes" in v for v in violations), violations

    def test_a_held_slot_toward_a_peer_that_cannot_read_it(self, serving_seed: int) -> None:
        hits = found(ServesEveryPeer, [serving_seed, *SEEDS], "does not read held rows")
        assert hits


class TestSelfCheck:
    @staticmethod
    def fake_run(held: HeldCounts) -> Callable[..., SeedResult]:
        def run(seed: int, nodes: int, ticks: int, *, soak: bool) -> SeedResult:
            return SeedResult(seed, nodes, ticks, (), 4, 1, 0, 0, 2, 0, held=held)

        return run

    def test_held_blocks_that_never_serve_fail_the_run(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        idle = HeldCounts(nodes=2, kept=50, released=40)
        monkeypatch.setattr(cli, "run_seed", self.fake_run(idle))
        assert cli.main(["--seeds", str(cli.HELD_SELF_CHECK_WORLDS)]) == 1
        lines = capsys.readouterr().out.splitlines()
        assert any(line.startswith("FAILED self-check: 20 worlds kept") for line in lines)
        assert (
            lines[-3]
            == "held: worlds=20 nodes=40 kept=1000 released=800 skipped=0 served=0 written=0"
        )
        assert lines[-1].startswith("seeds=20 violations=1 ")

    def test_serving_held_blocks_pass(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        serving = HeldCounts(nodes=1, kept=5, served=2, written=1)
        monkeypatch.setattr(cli, "run_seed", self.fake_run(serving))
        assert cli.main(["--seeds", str(cli.HELD_SELF_CHECK_WORLDS)]) == 0
        assert "self-check" not in capsys.readouterr().out

    def test_too_few_held_worlds_prove_nothing_either_way(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(cli, "run_seed", self.fake_run(HeldCounts(nodes=1, kept=5)))
        assert cli.main(["--seeds", str(cli.HELD_SELF_CHECK_WORLDS - 1)]) == 0
        assert cli.main(["--seeds", "40", "--ticks", "20"]) == 0
