"""Pulling ahead in the simulation: used for real, and every check of it can fail.

Worlds whose nodes pull ahead (kvpeer.lab.sim.ahead) serve loads from staged blocks;
a staging area that stages a failed fetch, never lets a staged block expire or loses
a row is reported; a world that does not pull ahead is the world it was before pulling
ahead was modelled; a CLI run whose staged blocks were never used fails its
self-check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from kvpeer.lab.sim import SeedResult, run_seed
from kvpeer.lab.sim import seeds as cli
from kvpeer.lab.sim.ahead import AheadCounts, draw_ahead
from kvpeer.node.ahead import PullAhead
from kvpeer.types import Key

SEEDS = range(40)
PEERS = ["n0:5710", "n1:5710", "n2:5710"]


def counts(result: SeedResult) -> AheadCounts:
    assert result.ahead is not None
    return result.ahead


@pytest.fixture(scope="module")
def using_seed() -> int:
    """A seed whose world, pulling ahead forced, runs clean and uses staged blocks."""
    for seed in SEEDS:
        result = run_seed(seed, ahead=True)
        if not (result.violations or result.deaths) and counts(result).used >= 2:
            return seed
    raise AssertionError(f"no seed of {SEEDS} used staged blocks cleanly")


class TestUsed:
    def test_worlds_that_pull_ahead_use_staged_blocks(self) -> None:
        results = [run_seed(seed, ahead=True) for seed in range(12)]
        assert [r.violations for r in results] == [()] * len(results)
        total = sum((counts(r) for r in results), AheadCounts())
        assert total.sent > 0
        assert total.staged > 0
        assert total.used > 0
        assert total.expired > 0
        assert total.refused > 0
        assert sum(counts(r).used > 0 for r in results) >= 4

    def test_half_of_the_worlds_pull_ahead(self) -> None:
        drawn = [draw_ahead(seed, PEERS) for seed in range(200)]
        assert 70 < sum(bool(d) for d in drawn) < 130
        assert draw_ahead(1, PEERS, always=True)

    def test_a_world_that_does_not_pull_ahead_is_unchanged(self) -> None:
        seed = next(s for s in range(20) if not draw_ahead(s, PEERS))
        drawn = run_seed(seed)
        assert drawn.ahead is None
        assert drawn == run_seed(seed, ahead=False)


def first_hits(seeds: Sequence[int], text: str) -> list[str]:
    for seed in seeds:
        hits = [v for v in run_seed(seed, ahead=True).violations if text in v]
        if hits:
            return hits
    return []


class TestNegativeControls:
    """Each check of pulling ahead reports the defect it is for."""

    def test_a_failed_fetch_staged_as_if_it_landed(
        self, using_seed: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        end = PullAhead._end_fetch

        def stages_failures(self: PullAhead, job_id: int, *, success: bool,
                            now: float = 0.0) -> None:  # fmt: skip
            end(self, job_id, success=True, now=now)

        monkeypatch.setattr(PullAhead, "_end_fetch", stages_failures)
        assert first_hits([using_seed, *SEEDS], "bytes")

    def test_staged_blocks_that_never_expire(
        self, using_seed: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(PullAhead, "expire", lambda self, now: None)
        assert first_hits([using_seed, *SEEDS], "after the quiet phase: staged blocks")

    def test_a_row_lost_on_release(
        self, using_seed: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def loses_rows(self: PullAhead, keys: Sequence[Key]) -> None:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.fetch is None:
                    del self._entries[key]  # the row is never freed

        monkeypatch.setattr(PullAhead, "_release", loses_rows)
        assert first_hits([using_seed, *SEEDS], "staging counts")


class TestSelfCheck:
    @staticmethod
    def fake_run(ahead: AheadCounts) -> Callable[..., SeedResult]:
        def run(seed: int, nodes: int, ticks: int, *, soak: bool) -> SeedResult:
            return SeedResult(seed, nodes, ticks, (), 4, 1, 0, 0, 2, 0, ahead=ahead)

        return run

    def test_staged_blocks_never_used_fail_the_run(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        unused = AheadCounts(nodes=1, sent=3, staged=4, expired=4)
        monkeypatch.setattr(cli, "run_seed", self.fake_run(unused))
        assert cli.main(["--seeds", str(cli.HELD_SELF_CHECK_WORLDS)]) == 1
        lines = capsys.readouterr().out.splitlines()
        assert any(line.startswith("FAILED self-check: 20 worlds pulled ahead") for line in lines)
        assert lines[-4].startswith("ahead: worlds=20 nodes=20 sent=60 ")
        assert lines[-1].startswith("seeds=20 violations=1 ")

    def test_used_staged_blocks_pass(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        used = AheadCounts(nodes=1, sent=3, staged=4, used=2)
        monkeypatch.setattr(cli, "run_seed", self.fake_run(used))
        assert cli.main(["--seeds", str(cli.HELD_SELF_CHECK_WORLDS)]) == 0
        assert "self-check" not in capsys.readouterr().out
