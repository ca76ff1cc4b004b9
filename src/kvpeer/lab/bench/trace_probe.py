"""What this machine's ``vllm serve`` engines cost, measured on the arm's own engines
before ``kvpeer bench trace`` sends its window (``--probe``): the figures the fleet model's
CPU preset (``kvpeer.lab.fleet.params.CPU_PAIR``) is set from.

Rules:

1. Every probe prompt is fresh (random tokens of the serving model's ordinary ids, from a
   fixed seed): no engine holds any of it, and it shares no block with a trace's prompts.
2. Requests go straight to an engine (not through the router), one at a time, except the
   batch decode; a figure is the median of ``rounds`` tries.
3. ``prefill``: TTFT of a fresh prompt of each length alone; ``hit``: TTFT of a prompt the
   engine has just computed (every full block cached); ``decode``: a request's
   (latency - TTFT) over its output tokens after the first, alone and ``BATCH`` at once;
   ``pull`` (an engine with kvpeer's tier): TTFT on engine ``b`` of a prompt engine ``a``
   computed, pinned through the router with ``a`` named as its source.
4. ``pair_prefill_ttft_s``: both engines at once, each a fresh prompt of the longest
   length: the later TTFT. On this machine the two engines share its cores (with each
   other, their servers, the router and whatever else runs), as they do whenever a
   window keeps both busy; alone they do not. Both engines first compute one prompt of
   that length each (a first long prefill is slower), and each pair is taken right
   after ``a`` computes one alone (``pair_alone_ttft_s``): ``pair_slowdown`` is the
   median of those rounds' pair/alone, so the machine's drift between the two does not
   enter it (taken the old way, three pairs after all the prefills alone and after one
   short prompt per engine, two idle engines gave 1.10-1.45x where ``kvpeer bench
   corun``, in turns after a warm-up, gives 0.99-1.16x). ``loadavg_1m``: the machine's load when the
   probe ended (``os.getloadavg``), to read the figures by.
5. ``frontend``: what the API servers, the router and the sender cost in CPU per
   request and per output token, and ``a``'s prefill while ``b`` streams
   (:mod:`.frontend_probe`, rules there); a failure there costs that part only.
6. ``prefill_cores_by_role`` and ``pair_cores_by_role``: the cores each role
   (:func:`~kvpeer.lab.bench.frontend_probe.cpu_by_role`) used on average over the
   prefills alone and over the pair's: what runs beside the workers while they compute;
   ``long_prefill_cores_by_role`` over rule 4's prefills alone, the longest length only
   (the short ones are mostly the scheduler's per-request work).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvpeer.lab.bench.frontend_probe import cpu_by_role, probe_frontend
from kvpeer.lab.bench.serve_client import run_phase
from kvpeer.lab.bench.serve_stats import RequestRecord
from kvpeer.lab.bench.serve_workloads import VOCAB, BenchRequest

__all__ = ["PROBE_LENGTHS", "ProbedArm", "probe"]

PROBE_LENGTHS = (64, 512, 1024, 1536, 2016)
DECODE_TOKENS = 48
BATCH = 4  # the engines' --max-num-seqs
INDEX_WAIT_S = 10.0


class ProbedArm(Protocol):
    engine_urls: list[str]
    engine_groups: list[int]

    @property
    def urls(self) -> Mapping[str, str]: ...

    def wait_indexed(self, held: Sequence[tuple[str, Sequence[int]]],
                     timeout_s: float) -> None: ...  # fmt: skip


def _send(requests: Sequence[BenchRequest], url: str) -> list[RequestRecord]:
    return _checked(asyncio.run(run_phase(requests, {"shared": url}, sender="vllm")))


def _checked(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    for record in records:
        if record.error is not None:
            raise RuntimeError(f"probe request failed: {record.error}")
    return list(records)


def _send_both(prompts: tuple[tuple[int, ...], tuple[int, ...]], urls: Sequence[str]
               ) -> list[RequestRecord]:  # fmt: skip
    """Rule 4: one prompt to each engine, at once."""

    async def both() -> list[RequestRecord]:
        phases = [run_phase([BenchRequest(0.0, prompt, 1)], {"shared": url}, sender="vllm")
                  for prompt, url in zip(prompts, urls, strict=True)]  # fmt: skip
        return [r for records in await asyncio.gather(*phases) for r in records]

    return _checked(asyncio.run(both()))


class _Cores:
    """Rule 6: cores used by role from construction to :meth:`used`."""

    def __init__(self, groups: Sequence[int]) -> None:
        self._groups = groups
        self._before = cpu_by_role(groups)
        self._started = time.monotonic()

    def used(self) -> dict[str, float]:
        after, wall = cpu_by_role(self._groups), time.monotonic() - self._started
        return {role: (after[role] - self._before[role]) / wall for role in after}


def _median_roles(samples: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each role's median over ``samples`` (the roles of the first)."""
    return {role: statistics.median(s[role] for s in samples) for role in samples[0]}


def probe(arm: ProbedArm, *, pulls: bool, rounds: int = 3) -> dict[str, Any]:
    """Rules 1-4 on ``arm``'s engines; seconds, lengths in tokens."""
    rng = random.Random("trace-probe")

    def fresh(length: int) -> tuple[int, ...]:
        return tuple(rng.randrange(*VOCAB) for _ in range(length))

    a = arm.engine_urls[0]
    longest = PROBE_LENGTHS[-1]
    for url in arm.engine_urls[:2]:  # rule 4: a first long prefill is slower
        _send([BenchRequest(0.0, fresh(longest), 1)], url)
    prefill: dict[int, list[float]] = {n: [] for n in PROBE_LENGTHS}
    hit: list[float] = []
    alone_cpu = _Cores(arm.engine_groups)
    for _ in range(rounds):
        for length in PROBE_LENGTHS:
            prompt = fresh(length)
            prefill[length].append(_send([BenchRequest(0.0, prompt, 1)], a)[0].ttft_s)
        hit.append(_send([BenchRequest(0.0, prompt, 1)], a)[0].ttft_s)
    alone_cores = alone_cpu.used()
    decode: dict[int, list[float]] = {1: [], BATCH: []}
    for _ in range(rounds):
        for batch in (1, BATCH):
            records = _send([BenchRequest(0.0, fresh(64), DECODE_TOKENS + 1)
                             for _ in range(batch)], a)  # fmt: skip
            # the batch decodes together once the last of them has its first token
            together = max(r.ttft_s + r.sent_s for r in records)
            ends = [r.done_s for r in records]
            decode[batch].append((min(ends) - together) / DECODE_TOKENS)
    pair: list[float] = []
    alone: list[float] = []
    alone_used: list[dict[str, float]] = []
    pair_used: list[dict[str, float]] = []
    for _ in range(rounds):  # rule 4: each pair right after a prefill alone
        cores = _Cores(arm.engine_groups)
        alone.append(_send([BenchRequest(0.0, fresh(longest), 1)], a)[0].ttft_s)
        alone_used.append(cores.used())
        cores = _Cores(arm.engine_groups)
        pair.append(max(r.ttft_s for r in _send_both((fresh(longest), fresh(longest)),
                                                     arm.engine_urls[:2])))  # fmt: skip
        pair_used.append(cores.used())
    out: dict[str, Any] = {
        "prefill_ttft_s": {str(n): statistics.median(v) for n, v in prefill.items()},
        "pair_prefill_ttft_s": {str(longest): statistics.median(pair)},
        "pair_alone_ttft_s": {str(longest): statistics.median(alone)},
        "pair_slowdown": statistics.median(p / s for p, s in zip(pair, alone, strict=True)),
        "hit_ttft_s": statistics.median(hit), "hit_prompt_tokens": PROBE_LENGTHS[-1],
        "decode_step_s": {str(n): statistics.median(v) for n, v in decode.items()},
        "prefill_cores_by_role": alone_cores, "pair_cores_by_role": _median_roles(pair_used),
        "long_prefill_cores_by_role": _median_roles(alone_used),
    }
    if pulls:
        pulled: dict[int, list[float]] = {n: [] for n in PROBE_LENGTHS[2:]}
        for _ in range(rounds):
            for length, times in pulled.items():
                prompt = fresh(length)
                _send([BenchRequest(0.0, prompt, 1)], a)
                arm.wait_indexed([("a", prompt)], INDEX_WAIT_S)
                record = asyncio.run(run_phase(
                    [BenchRequest(0.0, prompt, 1, pin="b", source="a")], arm.urls,
                    sender="kvpeer"))[0]  # fmt: skip
                if record.error is None and (record.cached_tokens or 0) > 0:
                    times.append(record.ttft_s)
        out["pull_ttft_s"] = {str(n): statistics.median(v) for n, v in pulled.items() if v}
    try:
        out["frontend"] = probe_frontend(arm, fresh, longest=longest, rounds=rounds)
    except RuntimeError as exc:
        out["frontend"] = {"error": str(exc)}
    out["loadavg_1m"] = os.getloadavg()[0]
    return out
