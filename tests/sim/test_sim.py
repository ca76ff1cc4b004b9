"""The multi-node simulation: seeds keep every invariant, the CLI contract,
determinism, and negative controls proving that each kind of check can fail
(request budgets toward unreachable peers and their recovery included).

The sweep runs in this process, under this interpreter's hash seed; the CLI
pins ``PYTHONHASHSEED=0``, so a failing seed's printed command reproduces the
CLI's run (and usually, not always, this one).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvpeer.host import TieringHost
from kvpeer.lab.sim import SeedResult, World, run_seed
from kvpeer.lab.sim import seeds as cli
from kvpeer.lab.sim import world as world_module
from kvpeer.lab.sim.scenarios import GHOST_PEER
from kvpeer.lab.sim.timeouts import Bounds
from kvpeer.node import peermemory as peermemory_module

SWEEP = [(seed, 3) for seed in range(200)] + [(seed, 4) for seed in range(200, 260)]
#: Seeds (and node counts) that once failed beyond the sweep, kept as regressions.
PINNED = [
    # An ended session's lookup, on its parked link, overtaken by the next session's
    # connect on a fresh one: a reordering the network model allowed and ZMQ does not.
    (1005440, 3),
    # Pulling ahead: a job waiting on two fetches into staging failed over one; the
    # other landed and stayed claimed, so it never expired (kvpeer.node.ahead).
    (2747, 3),
    # Pulling ahead: a job joined a fetch toward another peer than its own source and
    # waited out that peer's budget (ahead invariant 8).
    (318, 3),
]
LAST_LINE = re.compile(r"seeds=(\d+) violations=(\d+) jobs=(\d+) loads_ok=(\d+) loads_failed=(\d+)")


@pytest.fixture(scope="module")
def sweep() -> list[SeedResult]:
    return [run_seed(seed, nodes) for seed, nodes in SWEEP]


@pytest.fixture(scope="module")
def clean_seed() -> int:
    """A seed whose world loads blocks, kills no node and breaks nothing (for the
    negative controls: what they plant must still be there at the end)."""
    for seed in range(60):
        result = run_seed(seed)
        if not (result.violations or result.deaths) and result.loads_ok_pd and result.loads_ok_sym:
            return seed
    raise AssertionError("none of the first 60 seeds ran clean without deaths")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpeer.sim", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def describe(results: list[SeedResult]) -> Iterator[str]:
    for result in results:
        yield (
            f"seed {result.seed} ({result.nodes} nodes): {len(result.violations)} violation(s), "
            f"first: {result.violations[0]}\n    reproduce: python -m kvpeer.sim --seeds 1 "
            f"--first-seed {result.seed} --nodes {result.nodes}"
        )


class TestPinnedSeeds:
    def test_pinned_seeds_keep_every_invariant(self) -> None:
        failing = [result for result in (run_seed(s, n) for s, n in PINNED) if result.violations]
        assert not failing, "\n".join(describe(failing))


@pytest.mark.slow  # a sweep of many seeds
class TestSweep:
    def test_every_seed_keeps_every_invariant(self, sweep: list[SeedResult]) -> None:
        failing = [result for result in sweep if result.violations]
        if failing:
            pytest.fail(
                f"{len(failing)} of {len(sweep)} seeds failed:\n" + "\n".join(describe(failing)),
                pytrace=False,
            )

    def test_blocks_move_through_pd_and_symmetric_loads(self, sweep: list[SeedResult]) -> None:
        assert sum(result.loads_ok_pd for result in sweep) > 100
        assert sum(result.loads_ok_sym for result in sweep) > 100
        assert sum(result.loads_failed for result in sweep) > 0  # faults really happen
        assert sum(result.deaths for result in sweep) > 0

    def test_held_blocks_serve_release_and_fill_up(self, sweep: list[SeedResult]) -> None:
        held = [result.held for result in sweep if result.held is not None]
        assert len(held) > len(sweep) // 3  # half of the worlds draw held blocks
        assert sum(h.written > 0 for h in held) > len(held) * 3 // 4  # engine-less serving
        assert sum(h.released > 0 for h in held) > len(held) // 2  # the copy is full
        assert sum(h.skipped > 0 for h in held) > 3  # every row pinned: a block not kept

    def test_every_network_fault_kind_happens(self, sweep: list[SeedResult]) -> None:
        assert sum(result.partitions for result in sweep) > 100
        assert sum(result.freezes for result in sweep) > 30
        assert sum(result.restarts for result in sweep) > 30


class TestCli:
    def test_last_line_and_exit_status(self) -> None:
        proc = run_cli("--seeds", "5")
        last = proc.stdout.strip().splitlines()[-1]
        match = LAST_LINE.fullmatch(last)
        assert match is not None, proc.stdout
        assert int(match[1]) == 5
        assert int(match[3]) > 0
        assert int(match[4]) > 0
        assert proc.returncode == (1 if int(match[2]) else 0), proc.stdout

    def test_same_seeds_same_output_in_other_processes(self) -> None:
        args = ("--seeds", "4", "--first-seed", "11", "--nodes", "3", "--verbose")
        first = run_cli(*args)
        second = run_cli(*args, "--jobs", "2")
        assert first.stdout == second.stdout
        assert first.stdout.count("seed=") == 4

    def test_a_failing_seed_prints_its_reproduction(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        def fake_run(seed: int, nodes: int, ticks: int, *, soak: bool) -> SeedResult:
            found = ("t=1.00s n0: something broke",) if seed == 8 else ()
            return SeedResult(seed, nodes, ticks, found, 10, 2, 1, 3, 5, 0)

        monkeypatch.setattr(cli, "run_seed", fake_run)
        monkeypatch.setenv("PYTHONHASHSEED", "0")
        assert cli.main(["--seeds", "3", "--first-seed", "7", "--nodes", "4"]) == 1
        lines = capsys.readouterr().out.splitlines()
        assert "  reproduce: python -m kvpeer.sim --seeds 1 --first-seed 8 --nodes 4" in lines
        assert lines[-1] == "seeds=3 violations=1 jobs=30 loads_ok=9 loads_failed=9"

    def test_faults_are_summed(self) -> None:
        lines = run_cli("--seeds", "20").stdout.splitlines()
        faults = r"faults: deaths=(\d+) partitions=(\d+) freezes=(\d+) restarts=(\d+)"
        match = re.fullmatch(faults, lines[-2])
        assert match is not None, lines
        assert sum(int(n) for n in match.groups()) > 0

    def test_clean_run_exits_zero(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        def fake_run(seed: int, nodes: int, ticks: int, *, soak: bool) -> SeedResult:
            return SeedResult(seed, nodes, ticks, (), 4, 1, 0, 0, 2, 0)

        monkeypatch.setattr(cli, "run_seed", fake_run)
        assert cli.main(["--seeds", "2"]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == (
            "seeds=2 violations=0 jobs=8 loads_ok=2 loads_failed=0"
        )

    def test_time_per_seed_goes_to_stderr(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        def fake_run(seed: int, nodes: int, ticks: int, *, soak: bool) -> SeedResult:
            return SeedResult(seed, nodes, ticks, (), 4, 1, 0, 0, 2, 0)

        monkeypatch.setattr(cli, "run_seed", fake_run)
        assert cli.main(["--seeds", "2", "--nodes", "5"]) == 0
        captured = capsys.readouterr()
        assert "ms" not in captured.out  # stdout stays what CI parses
        assert re.search(
            r"kvpeer.sim: 2 seeds of 5 nodes in [\d.]+ s wall, [\d.]+ s CPU: \d+ ms wall, "
            r"\d+ ms CPU per seed",
            captured.err,
        ), captured.err

    def test_one_node_is_refused(self) -> None:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["--nodes", "1"])
        assert exit_info.value.code == 2
        with pytest.raises(ValueError, match="at least 2 nodes"):
            World(0, nodes=1)


class TestDeterminism:
    @pytest.mark.parametrize("seed", [3, 17])
    def test_same_seed_same_result(self, seed: int) -> None:
        assert run_seed(seed) == run_seed(seed)

    def test_other_seed_other_world(self) -> None:
        assert run_seed(3) != run_seed(4)

    def test_soak_runs_ten_times_the_ticks(self, clean_seed: int) -> None:
        short = run_seed(clean_seed, ticks=10)
        soak = run_seed(clean_seed, ticks=10, soak=True)
        assert soak.requests > 3 * short.requests


class TestNegativeControls:
    """The checker is not vacuous: each kind of defect is reported."""

    def test_wrong_bytes_in_loaded_slots(self, clean_seed: int) -> None:
        result = run_seed(clean_seed, corrupt_loads=True)
        assert any("does not hold the producer's bytes" in v for v in result.violations)

    def test_a_leaked_pin(self, clean_seed: int) -> None:
        result = run_seed(clean_seed, leak_pin=True)
        assert any("a pin outlived its job" in v for v in result.violations), result.violations
        assert any("after the quiet phase: pinned slots = 1" in v for v in result.violations)

    def test_an_exception_inside_a_node(
        self, monkeypatch: pytest.MonkeyPatch, clean_seed: int
    ) -> None:
        original = TieringHost.step
        steps = 0

        def failing_step(self: TieringHost) -> object:
            nonlocal steps
            steps += 1
            if steps == 100:
                raise RuntimeError("injected failure")
            return original(self)

        monkeypatch.setattr(TieringHost, "step", failing_step)
        result = run_seed(clean_seed)
        assert any(
            "RuntimeError during step of tick" in v and "injected failure" in v
            for v in result.violations
        ), result.violations

    def test_a_request_deferred_too_long(
        self, monkeypatch: pytest.MonkeyPatch, clean_seed: int
    ) -> None:
        monkeypatch.setattr(Bounds, "deferred", property(lambda self: 0.01))
        result = run_seed(clean_seed)
        assert any("deferred for" in v for v in result.violations)

    def test_a_job_reported_too_late(
        self, monkeypatch: pytest.MonkeyPatch, clean_seed: int
    ) -> None:
        monkeypatch.setattr(Bounds, "load", property(lambda self: 0.01))
        result = run_seed(clean_seed)
        assert any("load job" in v and "unreported" in v for v in result.violations)

    def test_a_frame_storm_stops_the_run(
        self, monkeypatch: pytest.MonkeyPatch, clean_seed: int
    ) -> None:
        monkeypatch.setattr(world_module, "STORM_FRAMES_PER_NODE_AND_TICK", 0)
        result = run_seed(clean_seed)
        assert len(result.violations) == 1
        assert "control-frame storm" in result.violations[0]


#: Seeds whose worlds send requests toward silent or partitioned peers.
UNREACHABLE_SEEDS = (7, 17, 18, 27)
#: Seeds whose worlds send PD requests toward a peer once unreachable and long healthy
#: again (the worlds change with the session's rules: these since the RENEWED rule).
#: Both sets were picked among worlds as they were before pulling ahead was modelled,
#: so they run with it off.
BACKED_OFF_SEEDS = (8, 40, 61, 69)


class TestRequestBudgets:
    """Budgets toward unreachable peers (kvpeer.lab.sim.budgets) are checked, not assumed."""

    def test_a_request_that_waits_out_a_session_timeout_is_reported(self) -> None:
        # The tiers wait 5.5 s on a peer that never answered; the checker expects the
        # seed's peer_wait_s (at most 2.6 s) plus its slack.
        found = [
            violation
            for seed in UNREACHABLE_SEEDS
            for violation in run_seed(
                seed, tier_overrides={"peer_wait_s": 5.5}, ahead=False
            ).violations
        ]
        assert found
        assert all("on silent peer" in v and "handshake_timeout_s" in v for v in found), found

    def test_a_back_off_that_never_ends_is_reported(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(peermemory_module, "FIRST_RETRY_S", 60.0)
        found = [
            violation
            for seed in BACKED_OFF_SEEDS
            for violation in run_seed(
                seed, tier_overrides={"peer_retry_max_s": 60.0}, ahead=False
            ).violations
        ]
        assert found
        assert all("turned away (MISS)" in v for v in found), found

    def test_a_half_open_session_at_the_end_is_reported(self, clean_seed: int) -> None:
        world = World(clean_seed)
        world.run()
        assert not world.ctx.violations
        pairs = [
            (a, b)
            for a in world.nodes
            for b in world.nodes
            if a.live is not None
            and b.live is not None
            and a.live.tier.session(b.peer_id) is not None
            and b.live.tier.session(a.peer_id) is not None
        ]
        assert pairs
        a, b = pairs[0]
        assert b.live is not None
        session = b.live.tier.session(a.peer_id)
        assert session is not None
        session.close("forgotten")  # its goodbye is never read: a keeps its side
        b.live.tier.get_finished_jobs()
        world.checker.sessions(world.nodes, GHOST_PEER)
        assert any(f"session {b.peer_id} half-open" in v for v in world.ctx.violations), (
            world.ctx.violations
        )

    @pytest.mark.parametrize("seed", [90, 112])
    def test_the_former_gaps_fail_without_pings(self, seed: int) -> None:
        """Seeds 90 and 161 (a peer froze mid-handshake; a session made ready by the
        peer's frames while our own link never connected) once waited past
        peer_wait_s by the node's design; the checker counted them. The node now
        gives up on a peer that has been silent for peer_wait_s in any state, and
        the checker is strict. Since peer_wait_s is drawn above 4/3 of a ping's round
        trip, the worlds differ: of seeds 0-299, 59, 62, 90 and 112 fail the old rule
        (only a peer never heard from is given up). These two are clean, and fail it."""
        assert run_cli("--seeds", "1", "--first-seed", str(seed)).returncode == 0
        out = run_variant(WITHOUT_THE_SILENCE_RULE, seed)
        assert "on silent peer" in out, out


#: The session's silence rule before pings: only a peer never heard from is given up
#: after peer_wait_s; one that spoke is left to the handshake deadline and heartbeat.
OLD_SILENCE_RULE = """
from kvpeer.session import liveness
def silence(self, started_at, answers_pings, answered):
    if not self.heard:
        return liveness.Silence(started_at + self._wait_s, None)
    return None
liveness.Liveness.silence = silence
"""


def script(template: str, seed: int) -> str:
    return template % {"seed": seed, "old_silence_rule": OLD_SILENCE_RULE}


def run_variant(template: str, seed: int) -> str:
    """Run one seed in a fresh interpreter with the code changed by ``template`` (a
    negative control: the fix undone); its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", script(template, seed)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    return proc.stdout

WITHOUT_THE_SILENCE_RULE = """
%(old_silence_rule)sfrom kvpeer.lab.sim import run_seed
for violation in run_seed(%(seed)d, ahead=False).violations:  # the world as it was
    print(violation)
"""


HALF_OPEN_SEED = 651
WITHOUT_THE_STRAY_ANSWER = """
from kvpeer.node import peertable
answer = peertable.PeerTable._refuse
def refuse(self, peer_id, frame, reason, *, quiet=False):
    if not quiet:  # strays go unanswered again, as before the fix
        answer(self, peer_id, frame, reason)
peertable.PeerTable._refuse = refuse
%(old_silence_rule)sfrom kvpeer.lab.sim import run_seed
for violation in run_seed(%(seed)d, ahead=False).violations:  # the world as it was
    print(violation)
"""


class TestHalfOpenSessionRegression:
    """Seed 651: a cut n1->n0 heals between the two links' heartbeat timeouts. n0's
    link dies, its session ends and its goodbye cannot connect through the cut; n1's
    link lives on, so n1 keeps a ready session n0 forgot. n0 dropped n1's frames as
    stragglers, so every request of n1 toward n0 waited out its timeouts, for ever.
    The tier now answers a straggler with a disconnect: n1's next request fails in a
    round trip and the one after is served. (n1's pings, unanswered, would also give
    the session up after peer_wait_s: the regression run takes both fixes out: n1's
    reunion request toward n0 then stays open on a healthy network.)"""

    def test_the_stale_side_is_served_again(self) -> None:
        proc = run_cli("--seeds", "1", "--first-seed", str(HALF_OPEN_SEED))
        assert proc.returncode == 0, proc.stdout

    def test_without_the_fix_the_seed_fails(self) -> None:
        out = run_variant(WITHOUT_THE_STRAY_ANSWER, HALF_OPEN_SEED)
        assert "reunion: request reunion-1-n1-n0 toward n0:5710 still open" in out, out


class TestLargeWorlds:
    """A world of 32 nodes: its reunion pulls between all 992 ordered pairs in one
    tick, which a storm budget linear in nodes called a storm (and stopped the run)."""

    def test_a_32_node_reunion_is_not_a_storm(self) -> None:
        result = run_seed(0, nodes=32, ticks=20)
        assert result.violations == ()
        assert result.loads_ok_sym >= 32 * 31  # every ordered pair was served

    def test_a_storm_is_still_caught_in_a_large_world(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(world_module, "STORM_FRAMES_PER_REUNION_PAIR", 0)
        found = run_seed(0, nodes=32, ticks=20).violations
        assert any("control-frame storm" in v for v in found), found
