"""``kvpeer bench serve``: time to first token under a workload, per secondary tier.

For each **arm** — ``none`` (no secondary tier), ``kvpeer``, ``vllm-p2p`` (vLLM 0.32's
own ``p2p`` tier) — two fresh ``vllm serve`` engines start with that tier, a ``shared``
and a ``pd`` ``kvpeer router`` go in front of them (the same router and the same
``kv_transfer_params`` for every arm), and every chosen workload
(:mod:`kvpeer.bench.serve_workloads`) is driven through the routers' OpenAI API
(:mod:`kvpeer.bench.serve_client`). The same seed gives every arm the same requests.
Numbers per arm x workload and the ratios between arms come from
:mod:`kvpeer.bench.serve_stats`.

The matrix runner (:func:`run_matrix`) only needs an :data:`OpenArm`: a context manager
per arm yielding the routers' URLs and the engines' counters. :class:`VllmArms` is the
real one; tests pass fakes (fake engines behind the real router), so everything but
``vllm serve`` itself is tested fast.

An arm that cannot run here (vLLM's tier needs NIXL; engines that fail to start) is
reported with its reason and the other arms still run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvpeer.bench.serve_client import run_phase
from kvpeer.bench.serve_stats import ArmError, Cell, PeerCounters, ratios, summarize
from kvpeer.bench.serve_workloads import (
    BLOCK_TOKENS,
    ENGINES,
    MAX_CONTEXT,
    WORKLOADS,
    BenchRequest,
    Shape,
    Workload,
    build,
)
from kvpeer.errors import ConfigError

if TYPE_CHECKING:
    from kvpeer.router.background import BackgroundRouter

__all__ = [
    "ARMS",
    "FULL_SHAPE",
    "QUICK_SHAPE",
    "ArmFleet",
    "ArmUnavailable",
    "BenchResult",
    "OpenArm",
    "ServeBenchSpec",
    "VllmArms",
    "add_arguments",
    "run_matrix",
]

ARMS = ("none", "kvpeer", "vllm-p2p")
ARM_TIERS = {"none": "none", "kvpeer": "kvpeer", "vllm-p2p": "p2p"}
DATA_PLANES = ("shm", "tcp", "nixl")
FULL_SHAPE = Shape(
    requests=24, rate=1.0, prompt_tokens=1536, suffix_tokens=128, output_tokens=16,
    turns=3, background_tokens=1536, think_s=1.0,
)  # fmt: skip
QUICK_SHAPE = Shape(
    requests=6, rate=2.0, prompt_tokens=1024, suffix_tokens=64, output_tokens=8,
    turns=3, background_tokens=1024, think_s=0.5,
)  # fmt: skip
INDEX_WAIT_S = 15.0  # a setup phase's prefixes must reach the router's index by then
COUNTERS_SETTLE_S = 5.0  # vLLM publishes kvpeer's counters with its next stats flush
KV_BYTES_PER_TOKEN = 24 * 1024  # the serving model's KV per token (float32)
# An engine that misses a health check is routed around and, when back, treated as
# restarted (its index entries dropped). On this 2-core machine vLLM's p2p EngineCores
# spin and starve the API servers past the router's default 1 s, which would charge the
# router's forgetting to that arm: the bench gives every arm the same generous timeout.
HEALTH_TIMEOUT_S = 10.0

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ServeBenchSpec:
    """Everything a run needs, validated here; every bad value is named."""

    arms: tuple[str, ...] = ARMS
    workloads: tuple[str, ...] = WORKLOADS
    shape: Shape = FULL_SHAPE
    seed: int = 0
    data_plane: str = "shm"

    def __post_init__(self) -> None:
        _check_names("--arms", self.arms, ARMS)
        _check_names("--workloads", self.workloads, WORKLOADS)
        if self.data_plane not in DATA_PLANES:
            raise ConfigError(
                f"--data-plane {self.data_plane!r}: choose one of {', '.join(DATA_PLANES)}"
            )
        s = self.shape
        if s.requests < 1:
            raise ConfigError(f"--requests {s.requests}: must be at least 1")
        if not (math.isfinite(s.rate) and s.rate > 0):
            raise ConfigError(f"--rate {s.rate}: must be a positive number of requests/s")
        if s.turns < 2:
            raise ConfigError(f"chat turns {s.turns}: must be at least 2")
        if s.prompt_tokens < 2 * BLOCK_TOKENS:
            raise ConfigError(
                f"prompt tokens {s.prompt_tokens}: must be at least {2 * BLOCK_TOKENS}"
            )
        longest = max(
            s.chat_tokens(),
            s.prompt_tokens + s.suffix_tokens + s.output_tokens,
            s.background_tokens + 1,
        )
        if longest >= MAX_CONTEXT:
            raise ConfigError(
                f"prompt tokens {s.prompt_tokens}: the longest request ({longest} tokens with "
                f"its output) must fit the engines' {MAX_CONTEXT}-token context"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeBenchSpec:
        shape = QUICK_SHAPE if args.quick else FULL_SHAPE
        if args.requests is not None:
            shape = replace(shape, requests=args.requests)
        if args.rate is not None:
            shape = replace(shape, rate=args.rate)
        return cls(
            arms=ARMS if args.arms is None else tuple(args.arms),
            workloads=WORKLOADS if args.workloads is None else tuple(args.workloads),
            shape=shape,
            seed=args.seed,
            data_plane=args.data_plane,
        )

    def cpu_bytes(self) -> int:
        """Each engine's CPU tier: room for every prefix busy-producer parks on ``a`` plus
        the background prefills that follow them (which would otherwise evict the
        prefixes before ``b`` pulls them), and some slack."""
        s = self.shape
        tokens = s.requests * (s.prompt_tokens + s.background_tokens + s.suffix_tokens)
        return tokens * KV_BYTES_PER_TOKEN + (256 << 20)


def _check_names(flag: str, given: Sequence[str], known: Sequence[str]) -> None:
    if not given:
        raise ConfigError(f"{flag}: name at least one of {', '.join(known)}")
    unknown = [name for name in given if name not in known]
    if unknown:
        raise ConfigError(f"{flag}: unknown {', '.join(map(repr, unknown))}; "
                          f"choose from {', '.join(known)}")
    repeated = sorted({name for name in given if given.count(name) > 1})
    if repeated:
        raise ConfigError(f"{flag}: {', '.join(map(repr, repeated))} given twice")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def names(text: str) -> list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]

    parser.add_argument("--arms", type=names,
                        help=f"comma-separated, of {','.join(ARMS)} (default: all)")
    parser.add_argument("--workloads", type=names,
                        help=f"comma-separated, of {','.join(WORKLOADS)} (default: all)")
    parser.add_argument("--requests", type=int,
                        help="measured requests per workload (default 24; --quick 6)")
    parser.add_argument("--rate", type=float,
                        help="Poisson arrivals per second (default 1; --quick 2)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help="few requests, 1,024-token prompts (about 10 minutes for 3 arms)")
    parser.add_argument("--data-plane", default="shm",
                        help="kvpeer's data plane: shm (default), tcp or nixl")
    parser.add_argument("--model",
                        help="checkpoint directory (default ~/.cache/kvpeer/serve-llama)")
    parser.add_argument("--log-dir", help="keep the engines' logs here (default: kept on failure)")
    parser.add_argument("--plot", help="write the TTFT CDFs (one panel per workload) to this PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


class ArmUnavailable(Exception):
    """This arm cannot run here (the message says why); the others still run."""


class ArmFleet(Protocol):
    """One arm's running engines behind its routers."""

    @property
    def urls(self) -> Mapping[str, str]:
        """Router kind (``shared``, ``pd``) → its base URL."""
        ...

    def counters(self) -> PeerCounters | None:
        """kvpeer's counters summed over the engines (None: the arm has no kvpeer tier)."""
        ...

    def wait_indexed(self, held: Sequence[tuple[str, Sequence[int]]], timeout_s: float) -> None:
        """Wait (bounded) until the router knows each engine holds its prompt."""
        ...


OpenArm = Callable[[str], AbstractContextManager[ArmFleet]]


@dataclass(frozen=True)
class BenchResult:
    spec: ServeBenchSpec
    cells: list[Cell]
    errors: list[ArmError]
    seconds: float
    logs: str | None = None
    setup_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.setup_errors and all(c.errors == 0 for c in self.cells)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seconds": round(self.seconds, 1),
            "spec": {**asdict(self.spec), "shape": asdict(self.spec.shape)},
            "cells": [c.to_json() for c in self.cells],
            "ratios": [asdict(r) for r in ratios(self.cells)],
            "arms_not_run": [asdict(e) for e in self.errors],
            "setup_errors": self.setup_errors,
            "logs": self.logs,
        }


def run_matrix(spec: ServeBenchSpec, open_arm: OpenArm, progress: Progress) -> BenchResult:
    """Every arm (fresh engines each) x every workload, one after another."""
    started = time.monotonic()
    workloads = [build(name, spec.shape, spec.seed) for name in spec.workloads]
    cells: list[Cell] = []
    errors: list[ArmError] = []
    setup_errors: list[str] = []
    for arm in spec.arms:
        try:
            with open_arm(arm) as fleet:
                for workload in workloads:
                    cell, failed = _run_workload(arm, workload, fleet, progress)
                    cells.append(cell)
                    setup_errors.extend(failed)
        except ArmUnavailable as exc:
            progress(f"arm {arm} did not run: {exc}")
            errors.append(ArmError(arm, str(exc)))
    return BenchResult(spec, cells, errors, time.monotonic() - started, setup_errors=setup_errors)


def _run_workload(
    arm: str, workload: Workload, fleet: ArmFleet, progress: Progress
) -> tuple[Cell, list[str]]:
    failed: list[str] = []
    if workload.setup:
        progress(f"{arm}/{workload.name}: setup, {len(workload.setup)} requests")
        records = asyncio.run(run_phase(workload.setup, fleet.urls))
        failed = [f"{arm}/{workload.name} setup: {r.error}" for r in records if r.error]
        held = [(r.pin, r.prompt) for r in workload.setup if r.pin is not None]
        fleet.wait_indexed(held, INDEX_WAIT_S)
    measured = workload.measured
    progress(f"{arm}/{workload.name}: {len(measured)} measured requests "
             f"({len(workload.main) - len(measured)} background)")
    before = fleet.counters()
    records = asyncio.run(run_phase(workload.main, fleet.urls))
    after = fleet.counters()
    counters = None if before is None or after is None else after - before
    kept = [rec for rec, req in zip(records, workload.main, strict=True) if req.measured]
    cell = summarize(arm, workload.name, kept, counters)
    progress(
        f"{arm}/{workload.name}: TTFT p50 {_ms(cell.ttft_p50_s)} p99 {_ms(cell.ttft_p99_s)}, "
        f"{cell.cached_tokens}/{cell.prompt_tokens} prompt tokens cached, {cell.errors} errors"
    )
    return cell, failed


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def unavailable(arm: str, data_plane: str) -> str | None:
    """Why ``arm`` cannot run on this machine, or None."""
    import importlib.util

    from kvpeer.integrations.vllm import VLLM_INSTALL_HINT

    if importlib.util.find_spec("vllm") is None:
        return VLLM_INSTALL_HINT
    needs_nixl = arm == "vllm-p2p" or (arm == "kvpeer" and data_plane == "nixl")
    if needs_nixl:
        from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend

        if not NixlBackend.available():
            what = "vLLM's p2p tier runs on NIXL" if arm == "vllm-p2p" else "data plane nixl"
            return f"{what}, which is not usable here: {INSTALL_HINT}"
    return None


@dataclass
class VllmArms:
    """The real :data:`OpenArm`: two fresh ``vllm serve`` engines per arm, two routers."""

    model: Path
    log_dir: Path
    data_plane: str
    cpu_bytes: int
    progress: Progress

    @contextlib.contextmanager
    def __call__(self, arm: str) -> Iterator[ArmFleet]:
        from kvpeer.integrations.vllm.serving import EngineFailed, ServeFleet, ServeSpec
        from kvpeer.router.background import BackgroundRouter
        from kvpeer.router.config import EngineEntry, RouterConfig
        from kvpeer.router.policy import Mode, Role

        reason = unavailable(arm, self.data_plane)
        if reason is not None:
            raise ArmUnavailable(reason)
        specs = [
            ServeSpec(name, self.model, tier=ARM_TIERS[arm],  # type: ignore[arg-type]
                      data_plane=self.data_plane, cpu_bytes=self.cpu_bytes)
            for name in ENGINES
        ]
        a, b = specs
        fleet = ServeFleet(self.log_dir / arm, self.progress)
        try:
            self.progress(f"arm {arm}: starting engines a and b ({ARM_TIERS[arm]} tier)")
            try:
                fleet.start(specs)
            except EngineFailed as exc:
                first = str(exc).splitlines()[0]
                raise ArmUnavailable(f"{first} (logs in {self.log_dir / arm})") from exc
            shared = BackgroundRouter(RouterConfig(
                Mode.SHARED, (EngineEntry(a.router_engine()), EngineEntry(b.router_engine())),
                listen_port=0, allow_pinning=True, health_timeout_s=HEALTH_TIMEOUT_S,
            ))  # fmt: skip
            try:
                pd = BackgroundRouter(RouterConfig(
                    Mode.PD, (EngineEntry(a.router_engine(Role.PREFILL)),
                              EngineEntry(b.router_engine(Role.DECODE))),
                    listen_port=0, health_timeout_s=HEALTH_TIMEOUT_S,
                ))  # fmt: skip
                try:
                    live = _LiveArm(shared, pd, [s.url for s in specs], arm == "kvpeer")
                    self.progress(f"arm {arm}: warm-up (each engine computes, pulls, and pd once)")
                    live.warm_up()
                    yield live
                finally:
                    pd.stop()
            finally:
                shared.stop()
        finally:
            fleet.close()


@dataclass
class _LiveArm:
    shared: BackgroundRouter
    pd: BackgroundRouter
    engine_urls: list[str]
    has_kvpeer: bool

    @property
    def urls(self) -> Mapping[str, str]:
        return {"shared": self.shared.url, "pd": self.pd.url}

    def warm_up(self) -> None:
        """Each engine's first requests are slow (and not learned from by the router):
        each computes a prompt directly, then pulls one from the other, then one PD pair."""
        import random

        rng = random.Random("warm-up")

        def fresh() -> tuple[int, ...]:
            return tuple(rng.randrange(3, 512) for _ in range(256))

        for url in self.engine_urls:
            asyncio.run(run_phase([BenchRequest(0.0, fresh(), 2)], {"shared": url}))
        for first, second in (("a", "b"), ("b", "a")):
            prompt = fresh()
            asyncio.run(run_phase([BenchRequest(0.0, prompt, 2, pin=first)], self.urls))
            self.wait_indexed([(first, prompt)], INDEX_WAIT_S)
            asyncio.run(run_phase([BenchRequest(0.0, prompt, 2, pin=second)], self.urls))
        asyncio.run(run_phase([BenchRequest(0.0, fresh(), 2, router="pd")], self.urls))

    def counters(self) -> PeerCounters | None:
        if not self.has_kvpeer:
            return None
        previous = _read_counters(self.engine_urls)
        deadline = time.monotonic() + COUNTERS_SETTLE_S
        while time.monotonic() < deadline:
            time.sleep(1.0)  # vLLM's stats flush period: two reads a flush apart agree
            current = _read_counters(self.engine_urls)
            if current == previous:
                break
            previous = current
        return previous

    def wait_indexed(self, held: Sequence[tuple[str, Sequence[int]]], timeout_s: float) -> None:
        from kvpeer.router.index import MEDIUM_CPU

        index = self.shared.router.index
        if index is None:
            return
        deadline = time.monotonic() + timeout_s
        for engine, prompt in held:
            full = len(prompt) // BLOCK_TOKENS * BLOCK_TOKENS
            def known(engine: str = engine, prompt: Sequence[int] = prompt) -> int:
                # Keys are empty until the index learns the block size: built each time.
                keys = index.keys(prompt)
                return index.longest_prefix(engine, keys, MEDIUM_CPU, time.monotonic())

            while time.monotonic() < deadline:
                if self.shared.call(known) >= full - BLOCK_TOKENS:
                    break
                time.sleep(0.05)


def _read_counters(urls: Sequence[str]) -> PeerCounters:
    from prometheus_client.parser import text_string_to_metric_families

    blocks = bytes_ = failed = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:kvpeer_pulled_blocks_total":
                    blocks += sample.value
                elif sample.name == "vllm:kvpeer_pulled_bytes_total":
                    bytes_ += sample.value
                elif (sample.name == "vllm:kvpeer_fetches_total"
                      and sample.labels.get("result") == "failed"):
                    failed += sample.value
    return PeerCounters(blocks, bytes_, failed)


def run(
    spec: ServeBenchSpec,
    *,
    model_dir: Path,
    log_dir: Path | None,
    progress: Progress,
) -> BenchResult:
    """The real benchmark: says at once which arms cannot run, then runs the matrix."""
    from kvpeer.integrations.vllm.model import SERVE_LLAMA_CONFIG, ensure_llama

    for arm in spec.arms:
        reason = unavailable(arm, spec.data_plane)
        if reason is not None:
            progress(f"arm {arm} cannot run here, the others will: {reason}")
    progress(f"model: {model_dir} (created on first use)")
    model = ensure_llama(model_dir, SERVE_LLAMA_CONFIG)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-bench-serve-"))
    arms = VllmArms(model, logs, spec.data_plane, spec.cpu_bytes(), progress)
    result = run_matrix(spec, arms, progress)
    if log_dir is None and result.ok:
        shutil.rmtree(logs, ignore_errors=True)
        return result
    return replace(result, logs=str(logs))
