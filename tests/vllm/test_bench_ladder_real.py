"""``kvpeer bench ladder --prompts 1`` for real: two ``vllm serve`` engines with the whole
kvpeer stack (held blocks, kvpeer's manager and connector) behind the router.

Checked, as a user would read the result: every rung measured, the pulls came from the
producer with the producer's own tokens and logprobs, and the slowest pull's timeline
shows the pull landing inside the lookup (``promotion`` with ``landed=1``) and the load
scheduled synchronously in the same engine step, from the client's send to its first
token. The rungs started ahead (a second router's prefetches, kvpeer.node.ahead) staged
their blocks in b before its lookup and b took them into its cache with no copy (the
slowest of them may be one whose request reached b first: b then refuses the prefetch and
pulls in the lookup); b's staging is empty again by the end. No speed is asserted
(docs/benchmarks.md has the measured ratios).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpeer.lab.bench.ladder import RUNGS
from kvpeer.lab.engines.procs import shm_names

pytestmark = pytest.mark.slow  # real engines, ~3 minutes

LADDER_TIMEOUT_S = 900


def test_one_round_of_the_ladder_lands_its_pulls_in_the_lookup(
    serve_llama: Path, tmp_path: Path
) -> None:
    shm_before = shm_names()
    command = [sys.executable, "-m", "kvpeer", "bench", "ladder", "--prompts", "1", "--json",
               "--idle-seconds", "0.5", "--model", str(serve_llama),
               # what is checked is that a pull lands in its lookup's step, not how fast:
               # the wait's bound is raised so a loaded CI machine cannot miss it
               "--sync-pull-wait", "1",
               "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=LADDER_TIMEOUT_S,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(done.stdout)
    assert all(len(result["samples"][rung]) == 1 for rung in RUNGS)
    assert (result["pulls"], result["same_output"]) == (6, 6)
    # a router may judge one pull slower than computing (it learns from each outcome);
    # the ones it pulled came from the producer
    assert result["pulled_from_producer"] >= 5
    events = [(event["engine"], event["event"]) for event in result["timeline"]]
    assert events[0] == ("client", "sent")
    assert ("client", "first_token") in events
    assert ("router", "sent") in events
    assert ("a", "fetch_received") in events  # the producer served it
    promotion = next(e for e in result["timeline"] if e["event"] == "promotion")
    assert promotion["engine"] == "b"
    assert "landed=1" in promotion["detail"]
    step = promotion["detail"].split("step=")[1]
    hit = next(e for e in result["timeline"] if e["event"] == "lookup_hit")
    assert hit["detail"].endswith(f"step={step}")  # looked up and landed in one step
    assert ("b", "sync_load_scheduled") in events
    ahead = [(event["engine"], event["event"]) for event in result["ahead_timeline"]]
    counts = result["ahead_counts"]
    assert ("a", "fetch_received") in ahead  # served by the producer either way
    if ("b", "prefetch") in ahead:
        assert ("b", "prefetch_done") in ahead
    else:
        # The request reached b before its prefetch did (the prefetch travels to the tier
        # while the request goes to the API server; on a loaded machine either can be
        # first): b refused the prefetch by design and pulled in the lookup. The other
        # rungs' prefetches must still have staged and been adopted (below).
        assert ("b", "lookup_hit") in ahead
        assert counts.get("refused", 0) >= 1
    assert counts["blocks_staged"] >= 48  # a 1,536-token prompt is 48 blocks
    assert counts["jobs_adopted"] >= 1
    assert shm_names() <= shm_before  # nothing left in /dev/shm
