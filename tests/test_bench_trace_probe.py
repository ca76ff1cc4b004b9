"""``bench trace --probe``'s order of work (rule 4), with the engines faked: both engines
warm up on the longest prompt first, and each pair is taken right after a prefill alone,
its slowdown the median of those rounds' ratios."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from kvpeer.lab.bench import trace_probe
from kvpeer.lab.bench.serve_stats import RequestRecord
from kvpeer.lab.bench.serve_workloads import BenchRequest

A, B = "http://a", "http://b"


class FakeArm:
    def __init__(self) -> None:
        self.engine_urls = [A, B]
        self.engine_groups = [1, 2]

    @property
    def urls(self) -> Mapping[str, str]:
        return {"shared": A}

    def wait_indexed(self, held: Sequence[tuple[str, Sequence[int]]],
                     timeout_s: float) -> None:  # fmt: skip
        raise AssertionError("no pulls are probed here")


def test_warm_up_first_then_each_pair_right_after_a_prefill_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[tuple[str, int]] = []
    # a's long prefills alone, in the order rule 4 takes them, and the pairs' later TTFTs
    alone_long = iter([1.0, 2.0, 1.0])
    pairs = iter([1.2, 2.2, 1.5])

    decoded: list[bool] = []  # the decode probe ran: what comes after is rule 4's

    def send(requests: Sequence[BenchRequest], url: str) -> list[RequestRecord]:
        out = []
        for request in requests:
            log.append((url, len(request.prompt)))
            ttft = 0.001 * len(request.prompt)
            if request.max_tokens > 1:
                decoded.append(True)
            elif decoded and len(request.prompt) == 2016:
                ttft = next(alone_long)
            out.append(RequestRecord(0.0, ttft, ttft + 0.01 * request.max_tokens,
                                     len(request.prompt), request.max_tokens, None))  # fmt: skip
        return out

    def send_both(prompts: tuple[tuple[int, ...], tuple[int, ...]], urls: Sequence[str]
                  ) -> list[RequestRecord]:  # fmt: skip
        log.append(("pair", len(prompts[0])))
        later = next(pairs)
        return [RequestRecord(0.0, later, later, 2016, 1, None),
                RequestRecord(0.0, later / 2, later, 2016, 1, None)]  # fmt: skip

    class Cores:
        def __init__(self, groups: Sequence[int]) -> None:
            pass

        def used(self) -> dict[str, float]:
            return {"worker": 1.0, "core": 0.1}

    def frontend(*_args: Any, **_kwargs: Any) -> dict[str, Any]:
        return {"error": "not probed here"}

    monkeypatch.setattr(trace_probe, "_send", send)
    monkeypatch.setattr(trace_probe, "_send_both", send_both)
    monkeypatch.setattr(trace_probe, "_Cores", Cores)
    monkeypatch.setattr(trace_probe, "probe_frontend", frontend)
    out = trace_probe.probe(FakeArm(), pulls=False, rounds=3)
    assert log[:2] == [(A, 2016), (B, 2016)]  # both engines warm up on the longest
    rounds = [entry for entry in log if entry[1] == 2016][-6:]
    assert rounds == [(A, 2016), ("pair", 2016)] * 3  # each pair right after one alone
    assert out["pair_slowdown"] == pytest.approx(1.2)  # median of 1.2, 1.1, 1.5
    assert out["pair_prefill_ttft_s"] == {"2016": 1.5}
    assert out["pair_alone_ttft_s"] == {"2016": 1.0}
    assert out["long_prefill_cores_by_role"] == {"worker": 1.0, "core": 0.1}
    assert out["pair_cores_by_role"] == {"worker": 1.0, "core": 0.1}
