"""``kvpeer fuzz``: argument parsing, the table and the JSON (no node is started)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kvpeer.cli import build_parser, main
from kvpeer.lab.fuzz.fuzz_run import CrashRecord, FuzzResult, FuzzSpec
from kvpeer.lab.fuzz.generator import Case
from kvpeer.lab.fuzz.legit import PullOutcome
from kvpeer.lab.fuzz.process import Usage
from kvpeer.lab.fuzz.report import render, to_json

MiB = 1 << 20


def test_defaults_are_a_million_frames_seed_zero() -> None:
    args = build_parser().parse_args(["fuzz"])
    assert args.frames == 1_000_000
    assert args.seed == 0
    assert args.data_planes is None  # resolved to what is installed
    assert not args.json
    assert not args.minimize
    assert not args.stop_on_crash


def test_every_option_parses() -> None:
    args = build_parser().parse_args(
        [
            "fuzz",
            "--frames",
            "5000",
            "--seed",
            "9",
            "--data-planes",
            "shm,tcp",
            "--checkpoint-every",
            "1000",
            "--exclude",
            "connect_ack/transport:tcp",
            "--exclude",
            "raw",
            "--stop-on-crash",
            "--minimize",
            "--workdir",
            "/tmp/somewhere",
            "--json",
        ]
    )
    assert (args.frames, args.seed, args.data_planes) == (5000, 9, ["shm", "tcp"])
    assert args.checkpoint_every == 1000
    assert args.exclude == ["connect_ack/transport:tcp", "raw"]
    assert args.stop_on_crash
    assert args.minimize
    assert args.json
    assert args.workdir == "/tmp/somewhere"


@pytest.mark.parametrize(
    "argv",
    [
        ["fuzz", "--frames", "10", "--data-planes", "rdma"],
        ["fuzz", "--frames", "0"],
    ],
)
def test_a_bad_spec_is_refused_before_anything_starts(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert "kvpeer:" in capsys.readouterr().err


def test_spec_checks_its_planes() -> None:
    with pytest.raises(ValueError, match="shm,tcp,nixl"):
        FuzzSpec(planes=("shm", "carrier-pigeon"))
    with pytest.raises(ValueError, match="shm,tcp,nixl"):
        FuzzSpec(planes=())


def _result(*, crashed: bool) -> FuzzResult:
    spec = FuzzSpec(frames=1000, seed=4, planes=("shm", "tcp"))
    result = FuzzResult(spec, 4, ("shm", "tcp"))
    result.frames_sent = 1000
    result.elapsed_s = 2.0
    result.node_starts = 2 if crashed else 1
    result.by_kind = Counter({"fetch": 600, "connect": 400})
    result.by_scenario = Counter({"handshake": 900, "raw": 100})
    result.by_label = Counter({"fetch/valid": 600, "connect/offer:tcp-hostile-port": 400})
    result.reactions = Counter(
        {"connect": 300, "disconnect: fetch '…': duplicate keys": 20, "abort_ack": 5}
    )
    result.reaction_frames = 325
    result.usage_start = Usage(300 * MiB, 150, 13)
    result.usage_warm = Usage(320 * MiB, 200, 20)
    result.usage_peak = Usage(350 * MiB, 400, 30)
    result.usage_end = Usage(340 * MiB, 160, 14)
    result.rss_bound = 576 * MiB
    result.fd_bound = 600
    result.pulls = [PullOutcome("shm", True, "", 0.01), PullOutcome("tcp", True, "", 0.02)]
    result.final_pulls = [PullOutcome("shm", True, "", 0.01), PullOutcome("tcp", True, "", 0.01)]
    result.exit_status = 0
    result.echo_max_s = 0.25
    result.dials = Counter({"own": 40, "named": 3})
    if crashed:
        case = Case("connect_ack/transport:tcp-empty-params", "handshake", 3, (b"\x80",), 17)
        result.crashes.append(
            CrashRecord(
                "driver: kvpeer.errors.DataPlaneError at tcp.py:accept_writer",
                "driver",
                "kvpeer.errors.DataPlaneError: tcp: 'x' sent no valid token: {}",
                "Traceback (most recent call last): ...",
                2,
                800,
                [case],
                799,
                count=3,
                reproducer=[case],
            )
        )
        result.driver_deaths = 3
    return result


def test_the_table_says_what_was_tried_and_how_the_node_reacted() -> None:
    table = render(_result(crashed=False))
    assert "1,000 frames in 2 s (500 frames/s), seed 4" in table
    assert "fetch" in table
    assert "disconnect: fetch '…': duplicate keys" in table
    assert "driver deaths: 0   thread deaths: 0" in table
    assert "legitimate pulls: 2 ok, 0 failed" in table
    assert "fresh peers after the run: 2/2 ok" in table
    assert "dials to an address a peer named (127.0.0.9): 3" in table
    assert "SIGINT -> exit 0" in table
    assert table.rstrip().endswith("kvpeer fuzz ok")


def test_a_crash_fails_the_run_and_shows_its_reproducer() -> None:
    result = _result(crashed=True)
    assert not result.ok
    table = render(result)
    assert "driver deaths: 3" in table
    assert "3x  driver: kvpeer.errors.DataPlaneError at tcp.py:accept_writer" in table
    assert "connect_ack/transport:tcp-empty-params" in table
    assert table.rstrip().endswith("kvpeer fuzz FAILED")


def test_a_failed_pull_or_a_problem_fails_the_run() -> None:
    result = _result(crashed=False)
    result.final_pulls.append(PullOutcome("tcp", False, "wrong bytes for blocks [3]", 0.1))
    assert not result.ok
    assert "failed over tcp: wrong bytes for blocks [3]" in render(result)
    result = _result(crashed=False)
    result.problems.append("after the goodbyes the node still holds 900 fds")
    assert not result.ok
    assert "problem: after the goodbyes the node still holds 900 fds" in render(result)


def test_a_problem_shows_the_end_of_the_nodes_log() -> None:
    result = _result(crashed=False)
    result.node_log = "".join(f"line {n}\n" for n in range(100))
    assert "line 99" not in render(result), "a run without problems keeps the report short"
    result.problems.append("SIGINT: the node exited with 2")
    table = render(result)
    assert "the node's log, last 30 lines:" in table
    assert "  | line 99" in table
    assert "  | line 70" in table
    assert "line 69\n" not in table
    assert table.rstrip().endswith("kvpeer fuzz FAILED")


def test_json_has_every_count() -> None:
    data = json.loads(json.dumps(to_json(_result(crashed=True))))
    assert data["ok"] is False
    assert data["frames_sent"] == 1000
    assert data["frames_by_kind"] == {"fetch": 600, "connect": 400}
    assert data["reactions"]["connect"] == 300
    assert data["driver_deaths"] == 3
    (crash,) = data["crashes"]
    assert crash["count"] == 3
    assert crash["reproducer"][0]["label"] == "connect_ack/transport:tcp-empty-params"
    assert data["usage"]["peak"] == {"rss_bytes": 350 * MiB, "fds": 400, "threads": 30}
    assert data["legit_pulls"]["by_plane"] == {
        "shm": {"ok": 1, "failed": 0},
        "tcp": {"ok": 1, "failed": 0},
    }
    assert data["findings"]["dials_to_peer_named_addresses"] == 3
