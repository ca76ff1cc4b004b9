"""The serving benchmark's workloads: seeded request lists, built before anything runs.

A workload is two phases of :class:`BenchRequest` s. The *setup* phase (run to the end,
then the router is given time to hear of it) puts prefixes where the workload needs
them; it is never measured. The *main* phase is sent at Poisson arrival times. Every
prompt is a tuple of token ids drawn from one ``random.Random(seed)``, so a seed gives
the same requests to every arm: arms differ only in the engines' secondary tier.

Invariants the runner relies on:

1. Main-phase arrival times are non-decreasing, starting near 0 (exponential gaps at
   ``rate`` per second).
2. ``after`` names an earlier main-phase request (by index) that must have finished
   before this one is sent; the request then waits ``think_s`` more (a user reading the
   answer). Only ``chat`` uses it: turn k+1's prompt starts with all of turn k's.
3. Two engines, ``a`` and ``b``. ``pin`` names the serving engine (``X-Kvpeer-Engine``);
   where to pull from is always the router's decision.
4. Every prompt fits the engines' context with its output (:data:`MAX_CONTEXT`).
5. *Unpinned* workloads (:data:`UNPINNED`) never pin: the router places every request,
   as it does for users. *Pinned* ones (:data:`PINNED`) place each request themselves, to
   compare what a pull costs in each tier rather than whether a router would choose one.
6. ``variant`` (the offered load's name) is part of the seed: the same workload at two
   loads on the same engines sends different prompts, so the second run finds nothing
   the first one cached.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ENGINES",
    "MAX_CONTEXT",
    "PINNED",
    "UNPINNED",
    "WORKLOADS",
    "BenchRequest",
    "Shape",
    "Workload",
    "build",
]

UNPINNED = ("prefix", "chat", "chat-skewed")
PINNED = ("pinned-chat", "system-prompt", "pd", "busy-producer")
WORKLOADS = UNPINNED + PINNED
ENGINES = ("a", "b")
MAX_CONTEXT = 2048  # the engines' --max-model-len
VOCAB = (3, 512)  # ordinary token ids of the serving model's word-level tokenizer
BLOCK_TOKENS = 32

RouterKind = Literal["shared", "pd"]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One completion request of a workload (token-id prompt, greedy, fixed output)."""

    at_s: float  # arrival, seconds after the phase starts
    prompt: tuple[int, ...]
    max_tokens: int
    router: RouterKind = "shared"
    pin: str | None = None  # serving engine; None: the router places it
    source: str | None = None  # pinned source to pull from (X-Kvpeer-Source)
    after: int | None = None  # main-phase index that must finish first
    think_s: float = 0.0  # wait after ``after`` finished
    measured: bool = True  # background load is sent but not counted
    text: str | None = None  # the prompt as text, when a dataset made it as text


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    setup: tuple[BenchRequest, ...]
    main: tuple[BenchRequest, ...]
    pinned: bool = True  # False: the router places every request (invariant 5)

    @property
    def measured(self) -> tuple[BenchRequest, ...]:
        return tuple(r for r in self.main if r.measured)


@dataclass(frozen=True, slots=True)
class Shape:
    """Sizes shared by all workloads of a run (validated by the bench spec)."""

    requests: int  # measured main-phase requests per workload
    rate: float  # Poisson arrivals per second
    prompt_tokens: int  # chat's first turn, the system prompt, a pd prompt, a busy prefix
    suffix_tokens: int  # chat's new message per turn, system-prompt's distinct suffix
    output_tokens: int
    turns: int  # chat turns per conversation
    background_tokens: int  # busy-producer's long prefills on the producer
    think_s: float  # chat: between an answer and the next turn
    prefixes: int = 6  # prefix: distinct shared prefixes (vLLM's --prefix-repetition-num-prefixes)

    def chat_tokens(self) -> int:
        """The longest chat prompt plus its answer (must fit :data:`MAX_CONTEXT`)."""
        return (
            self.prompt_tokens
            + (self.turns - 1) * (self.output_tokens + self.suffix_tokens)
            + self.output_tokens
        )


def build(
    name: str, shape: Shape, seed: int, *, variant: str = "", tokenizer: Any = None
) -> Workload:
    """The workload ``name`` for ``shape``; the same ``seed`` and ``variant`` give the same
    requests. ``prefix`` needs the served model's ``tokenizer`` (vLLM's dataset makes
    text prompts of an exact token length)."""
    rng = random.Random(f"{seed}:{name}" + (f":{variant}" if variant else ""))
    makers = {
        "chat": _unpinned_chat,
        "chat-skewed": _chat_skewed,
        "pinned-chat": _chat,
        "system-prompt": _system_prompt,
        "pd": _pd,
        "busy-producer": _busy_producer,
    }
    if name == "prefix":
        if tokenizer is None:
            raise ValueError("workload 'prefix': vLLM's dataset needs the model's tokenizer")
        return _prefix(shape, rng, tokenizer)
    if name not in makers:
        raise ValueError(f"workload {name!r}: choose from {', '.join(WORKLOADS)}")
    return makers[name](shape, rng)


def arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """``count`` Poisson arrival times at ``rate`` per second, the first at 0."""
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*VOCAB) for _ in range(count))


def _chat(shape: Shape, rng: random.Random) -> Workload:
    """Conversations of ``turns`` turns. Turn k+1's prompt is turn k's prompt, a seeded
    stand-in for its answer (what the client sends back as history) and a new message;
    consecutive turns alternate engines, so each turn's history sits on the other one."""
    return _conversations("pinned-chat", shape, rng, pinned=True)


def _unpinned_chat(shape: Shape, rng: random.Random) -> Workload:
    """Multi-turn chat as users send it: conversations interleaved, starting at Poisson
    times, turn k+1 (after turn k's answer and a think time) extending turn k; the
    router places every turn."""
    return _conversations("chat", shape, rng, pinned=False)


def _chat_skewed(shape: Shape, rng: random.Random) -> Workload:
    """``chat`` whose conversations open with a few shared openings (a system prompt and
    a document), drawn with Zipf popularity: the hot openings' holder gets busy, and
    whoever serves the next conversation either waits for it, computes the opening
    again, or pulls it."""
    opening_tokens = shape.prompt_tokens - shape.suffix_tokens
    count = -(-shape.requests // shape.turns)
    openings = [_tokens(rng, opening_tokens) for _ in range(max(2, count // 3))]
    weights = [1.0 / (rank + 1) ** 1.5 for rank in range(len(openings))]
    firsts = [
        rng.choices(openings, weights)[0] + _tokens(rng, shape.suffix_tokens)
        for _ in range(count)
    ]
    return _conversations("chat-skewed", shape, rng, pinned=False, firsts=firsts)


def _conversations(
    name: str, shape: Shape, rng: random.Random, *, pinned: bool,
    firsts: Sequence[tuple[int, ...]] = (),
) -> Workload:
    conversations = -(-shape.requests // shape.turns)
    starts = arrivals(conversations, shape.rate / shape.turns, rng)
    main: list[BenchRequest] = []
    for conversation, start in enumerate(starts):
        prompt = firsts[conversation] if firsts else _tokens(rng, shape.prompt_tokens)
        previous: int | None = None
        for turn in range(shape.turns):
            if len(main) == shape.requests:
                break
            if turn:
                answer = _tokens(rng, shape.output_tokens)
                prompt = prompt + answer + _tokens(rng, shape.suffix_tokens)
            main.append(
                BenchRequest(
                    at_s=start,
                    prompt=prompt,
                    max_tokens=shape.output_tokens,
                    pin=ENGINES[(conversation + turn) % 2] if pinned else None,
                    after=previous,
                    think_s=shape.think_s if turn else 0.0,
                )
            )
            previous = len(main) - 1
    # Arrival order for the runner: a turn is sent after its predecessor anyway.
    return Workload(name, (), tuple(main), pinned=pinned)


def _prefix(shape: Shape, rng: random.Random, tokenizer: Any) -> Workload:
    """vLLM's ``prefix_repetition`` dataset (``vllm bench serve --dataset-name
    prefix_repetition``): ``prefixes`` shared prefixes of ``prompt_tokens``, each with
    distinct ``suffix_tokens`` suffixes, shuffled; Poisson arrivals. The dataset seeds
    the process-wide ``random`` and ``numpy.random``: both are restored afterwards."""
    import numpy
    from vllm.benchmarks.datasets import PrefixRepetitionRandomDataset

    saved = random.getstate(), numpy.random.get_state()
    try:
        dataset = PrefixRepetitionRandomDataset(random_seed=rng.randrange(1 << 31))
        samples = dataset.sample(
            tokenizer, shape.requests, prefix_len=shape.prompt_tokens,
            suffix_len=shape.suffix_tokens, num_prefixes=min(shape.prefixes, shape.requests),
            output_len=shape.output_tokens,
        )  # fmt: skip
    finally:
        random.setstate(saved[0])
        numpy.random.set_state(saved[1])
    main: list[BenchRequest] = []
    for sample, at in zip(samples, arrivals(len(samples), shape.rate, rng), strict=True):
        if not isinstance(sample.prompt, str):
            raise TypeError(f"vLLM's prefix_repetition made a {type(sample.prompt)} prompt")
        ids = tuple(tokenizer.encode(sample.prompt, add_special_tokens=False))
        main.append(BenchRequest(at, ids, sample.expected_output_len, text=sample.prompt))
    return Workload("prefix", (), tuple(main), pinned=False)


def _system_prompt(shape: Shape, rng: random.Random) -> Workload:
    """One long shared prefix, computed once on ``a`` in the setup; then distinct short
    suffixes, placed round-robin (as a load balancer would), so ``b`` needs the prefix."""
    prefix = _tokens(rng, shape.prompt_tokens)
    setup = (BenchRequest(0.0, prefix + _tokens(rng, shape.suffix_tokens), 1, pin="a"),)
    main = tuple(
        BenchRequest(
            at_s=at,
            prompt=prefix + _tokens(rng, shape.suffix_tokens),
            max_tokens=shape.output_tokens,
            pin=ENGINES[(i + 1) % 2],
        )
        for i, at in enumerate(arrivals(shape.requests, shape.rate, rng))
    )
    return Workload("system-prompt", setup, main)


def _pd(shape: Shape, rng: random.Random) -> Workload:
    """Fresh prompts through the PD router: ``a`` prefills, ``b`` decodes."""
    main = tuple(
        BenchRequest(at, _tokens(rng, shape.prompt_tokens), shape.output_tokens, router="pd")
        for at in arrivals(shape.requests, shape.rate, rng)
    )
    return Workload("pd", (), main)


def _busy_producer(shape: Shape, rng: random.Random) -> Workload:
    """The setup computes one prefix per measured request on ``a``. Then ``a`` gets a
    long fresh prefill with every arrival (unmeasured), and the measured request (its
    prefix plus a short suffix) is served by ``b``, which pulls the prefix from the
    busy ``a`` (the source is pinned: the workload compares what a pull from a busy
    producer costs in each tier, not whether the router would choose one)."""
    prefixes = [_tokens(rng, shape.prompt_tokens) for _ in range(shape.requests)]
    setup = tuple(BenchRequest(0.0, prefix, 1, pin="a") for prefix in prefixes)
    main: list[BenchRequest] = []
    for prefix, at in zip(prefixes, arrivals(shape.requests, shape.rate, rng), strict=True):
        main.append(
            BenchRequest(at, _tokens(rng, shape.background_tokens), 1, pin="a", measured=False)
        )
        main.append(
            BenchRequest(
                at,
                prefix + _tokens(rng, shape.suffix_tokens),
                shape.output_tokens,
                pin="b",
                source="a",
            )
        )
    return Workload("busy-producer", setup, tuple(main))
