"""``kvpeer demo``'s verdicts and input checks (no engines: tests/vllm/test_demo.py runs it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpeer.lab.demo_run import DemoResult, PeerCounters, Pulled, judge, render
from kvpeer.lab.engines.openai_client import Completion

PROMPT = 256
BLOCK_LEN = 32 * 1024


def completion(
    tokens: list[int] | None = None,
    logprobs: list[float] | None = None,
    *,
    cached: int = 0,
    ttft: float = 0.4,
) -> Completion:
    tokens = tokens if tokens is not None else [5, 6, 7, 8]
    return Completion(
        tokens=tokens,
        logprobs=logprobs if logprobs is not None else [-1.0] * len(tokens),
        ttft_s=ttft,
        seconds=ttft + 0.1,
        prompt_tokens=PROMPT,
        cached_tokens=cached,
    )


def pulled(
    run: Completion | None = None, *, blocks: int = 8, source: str | None = "a"
) -> Pulled:
    run = run if run is not None else completion(cached=PROMPT, ttft=0.1)
    counters = PeerCounters(blocks, blocks * BLOCK_LEN, 0.002 if blocks else 0.0)
    return Pulled(run, run.ttft_s, source, counters)


def test_a_matching_pull_of_the_whole_prompt_passes() -> None:
    result = judge("shared", "tcp", PROMPT, completion(), completion(), pulled())

    assert result.ok
    assert result.outputs_match
    assert result.tokens_from_peer == 256
    assert result.bytes_from_peer == 8 * BLOCK_LEN
    assert result.transfer_gbps == pytest.approx(8 * BLOCK_LEN / 0.002 / 1e9)
    assert result.speedup == pytest.approx(4.0)
    assert result.api == "openai-http"
    assert result.source == "a"


def test_different_tokens_fail_the_scenario() -> None:
    run = completion([5, 6, 9, 8], cached=PROMPT)
    result = judge("pd", "tcp", PROMPT, completion(), completion(), pulled(run))

    assert not result.outputs_match
    assert not result.ok
    assert "tokens differ" in result.problems[0]


def test_logprobs_past_the_tolerance_fail_the_scenario() -> None:
    run = completion(logprobs=[-1.0, -1.0, -1.01, -1.0], cached=PROMPT)
    result = judge("shared", "shm", PROMPT, completion(), completion(), pulled(run))

    assert not result.outputs_match
    assert "logprobs differ" in result.problems[0]


@pytest.mark.parametrize(
    ("cached", "blocks"),
    [(0, 0), (256, 0), (256, 2)],
    ids=["computed", "cached-not-from-peer", "partial"],
)
def test_a_prompt_not_loaded_from_the_peer_fails_even_with_equal_outputs(
    cached: int, blocks: int
) -> None:
    run = completion(cached=cached)
    result = judge("shared", "shm", PROMPT, completion(), completion(), pulled(run, blocks=blocks))

    assert result.outputs_match
    assert not result.ok
    assert "came from the peer" in result.problems[0]


def test_a_plan_without_a_peer_fails_even_if_the_engine_had_the_blocks() -> None:
    result = judge("shared", "shm", PROMPT, completion(), completion(), pulled(source=None))

    assert not result.ok
    assert result.problems == ["the router named no peer to pull from"]


def test_a_local_run_that_reused_cache_is_no_local_baseline() -> None:
    local = completion(cached=64)
    result = judge("pd", "tcp", PROMPT, completion(), local, pulled())

    assert not result.ok
    assert "local run reused" in result.problems[0]


def test_chat_needs_only_the_previous_turns_from_the_peer() -> None:
    run = completion(cached=192)
    result = judge("chat", "shm", PROMPT, completion(), completion(), pulled(run, blocks=6),
                   expected_from_peer=list(range(192)))

    assert result.ok
    assert result.tokens_from_peer == 192


def test_render_shows_the_failure_the_speedup_and_the_logs() -> None:
    bad = judge("pd", "tcp", PROMPT, completion(), completion(),
                pulled(completion([1, 2, 3, 4], cached=PROMPT)))
    good = judge("shared", "tcp", PROMPT, completion(), completion(), pulled())
    result = DemoResult([bad, good], "tcp", "/m", 12.0, ["/logs/a.log"])

    text = render(result)
    assert not result.ok
    assert "DIFFER" in text
    assert "match" in text
    assert "4.0x" in text
    assert "kvpeer demo FAILED" in text
    assert "/logs/a.log" in text
    assert result.to_json()["scenarios"][0]["outputs_match"] is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-plane", "udp"], "data plane 'udp': choose one of shm, tcp, nixl"),
        (["--prompt-tokens", "5000"], "prompt tokens 5000: must be 64..1536"),
        (["--prompt-tokens", "8"], "prompt tokens 8: must be 64..1536"),
    ],
)
def test_bad_options_are_named_before_any_engine_starts(argv: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpeer", "demo", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert "starting engine" not in done.stderr
