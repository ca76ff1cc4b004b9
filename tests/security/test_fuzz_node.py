"""A real node under generated hostile frames (issue 15, item 2).

``kvpeer serve`` runs on every data plane installed here (shm, tcp, and nixl where
present) while the fuzzer sends it generated frames of every message type, valid
and broken, in handshake order and out of it, from a few dozen identities. Between
them the suite sends more than 100,000 frames. Whatever arrives, the node's driver
must never die, its memory and descriptors stay bounded, it drops back to its
start-up descriptors and threads once the fuzz peers leave, a legitimate peer on
every data plane pulls byte-exact all along and afterwards, and SIGINT stops it
cleanly. ``kvpeer fuzz`` runs the same harness for a million frames and more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpeer.lab.fuzz.fuzz_run import FuzzResult, FuzzSpec, available_planes, run_fuzz
from kvpeer.lab.fuzz.generator import MESSAGE_TYPES
from kvpeer.lab.fuzz.report import render

pytestmark = pytest.mark.slow  # a live node under 100,000 frames

FRAMES_PER_RUN = 50_000
SEEDS = (1, 2)  # 2 x 50,000 frames: the suite's 100,000


def fuzz(seed: int, workdir: Path) -> FuzzResult:
    spec = FuzzSpec(
        frames=FRAMES_PER_RUN,
        seed=seed,
        planes=available_planes(),  # nixl only trusts nixl_peers (docs/security.md)
        checkpoint_every=FRAMES_PER_RUN // 2,
        warmup=5_000,
        keep_going=False,  # a test stops at the first death (kvpeer fuzz goes on)
        workdir=workdir,
    )
    return run_fuzz(spec)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_node_survives_generated_frames_and_still_serves(seed: int, tmp_path: Path) -> None:
    result = fuzz(seed, tmp_path)
    report = render(result)

    # The driver never died, nor did any other thread of the node.
    assert [c.signature for c in result.crashes] == [], report
    assert (result.driver_deaths, result.thread_deaths, result.node_starts) == (0, 0, 1), report
    assert result.frames_sent == FRAMES_PER_RUN, report
    assert set(result.by_kind) >= set(MESSAGE_TYPES), "the generator skipped message types"
    # Bounded: RSS and descriptors at every checkpoint, and back to start-up after.
    assert result.usage_peak is not None
    assert result.usage_end is not None, report
    assert result.usage_peak.rss_bytes <= result.rss_bound, report
    assert result.usage_peak.fds <= result.fd_bound, report
    assert result.problems == [], report
    # A legitimate peer on every plane was served all along, and fresh ones after.
    assert result.pulls
    assert all(p.ok for p in result.pulls), report
    assert sorted(p.plane for p in result.final_pulls) == sorted(result.planes), report
    assert all(p.ok for p in result.final_pulls), report
    # Ctrl-C stops it cleanly.
    assert result.exit_status == 0, report
    assert result.shm_left == [], report
