"""``kvpeer demo``'s verdicts and input checks (no engines: tests/vllm/test_demo.py runs it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpeer.demo import DemoResult, judge, render
from kvpeer.integrations.vllm.launcher import Generation

PROMPT = 256
BLOCK_LEN = 32 * 1024


def generation(
    tokens: list[int] | None = None,
    logprobs: list[float] | None = None,
    *,
    cached: int = 0,
    blocks: int | None = None,
) -> Generation:
    tokens = tokens if tokens is not None else [5, 6, 7, 8]
    return Generation(
        tokens=tokens,
        logprobs=logprobs if logprobs is not None else [-1.0] * len(tokens),
        num_cached_tokens=cached,
        ttft_s=0.01,
        blocks_from_peer=blocks,
        bytes_from_peer=None if blocks is None else blocks * BLOCK_LEN,
        load_seconds=None if blocks is None else 0.002,
    )


def test_a_matching_pull_of_the_whole_prompt_passes() -> None:
    result = judge("pd", "tcp", PROMPT, generation(), generation(cached=256, blocks=8))

    assert result.ok
    assert result.outputs_match
    assert result.tokens_from_peer == 256
    assert result.bytes_from_peer == 8 * BLOCK_LEN
    assert result.transfer_gbps == pytest.approx(8 * BLOCK_LEN / 0.002 / 1e9)


def test_different_tokens_fail_the_scenario() -> None:
    result = judge(
        "pd", "tcp", PROMPT, generation(), generation([5, 6, 9, 8], cached=256, blocks=8)
    )

    assert not result.outputs_match
    assert not result.ok
    assert "tokens differ" in result.problems[0]


def test_logprobs_past_the_tolerance_fail_the_scenario() -> None:
    pulled = generation(logprobs=[-1.0, -1.0, -1.01, -1.0], cached=256, blocks=8)
    result = judge("symmetric", "shm", PROMPT, generation(), pulled)

    assert not result.outputs_match
    assert "logprobs differ" in result.problems[0]


@pytest.mark.parametrize(
    ("cached", "blocks"),
    [(0, 0), (256, 0), (256, None), (256, 2)],
    ids=["computed", "cached-not-from-peer", "no-counters", "partial"],
)
def test_a_prompt_not_loaded_from_the_peer_fails_even_with_equal_outputs(
    cached: int, blocks: int | None
) -> None:
    result = judge(
        "symmetric", "shm", PROMPT, generation(), generation(cached=cached, blocks=blocks)
    )

    assert result.outputs_match
    assert not result.ok
    assert "came from the peer" in result.problems[0]


def test_a_local_reference_that_reused_cache_is_no_reference() -> None:
    result = judge("pd", "tcp", PROMPT, generation(cached=64), generation(cached=256, blocks=8))

    assert not result.ok
    assert "local reference" in result.problems[0]


def test_render_shows_the_failure_and_the_logs() -> None:
    bad = judge("pd", "tcp", PROMPT, generation(), generation([1, 2, 3, 4], cached=256, blocks=8))
    good = judge("symmetric", "tcp", PROMPT, generation(), generation(cached=256, blocks=8))
    result = DemoResult([bad, good], "tcp", "/m", 12.0, ["/logs/a.log"])

    text = render(result)
    assert not result.ok
    assert "DIFFER" in text
    assert "match" in text
    assert "kvpeer demo FAILED" in text
    assert "/logs/a.log" in text
    assert result.to_json()["scenarios"][0]["outputs_match"] is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-plane", "udp"], "data plane 'udp': choose one of shm, tcp, nixl"),
        (["--prompt-tokens", "5000"], "prompt tokens 5000: must be 64..448"),
        (["--prompt-tokens", "8"], "prompt tokens 8: must be 64..448"),
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
