"""The real arms of ``kvpeer bench serve``: two fresh ``vllm serve`` engines per arm with
that arm's tier, a ``shared`` and a ``pd`` ``kvpeer router`` in front, a warm-up, and
kvpeer's counters read from the engines' ``/metrics``. Split from :mod:`.serve` so the
matrix, spec and statistics stay testable without vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvpeer.lab.bench.serve_bench import (
    ARM_POLICIES,
    ARM_TIERS,
    INDEX_WAIT_S,
    PINNED_ARMS,
    ArmFleet,
    ArmUnavailable,
    BenchResult,
    ServeBenchSpec,
    run_matrix,
)
from kvpeer.lab.bench.serve_client import run_phase
from kvpeer.lab.bench.serve_stats import FleetCounters, PeerCounters
from kvpeer.lab.bench.serve_trace import TRACE_ENV, RouterCapture, Slowest, read_logs
from kvpeer.lab.bench.serve_workloads import BLOCK_TOKENS, ENGINES, BenchRequest

if TYPE_CHECKING:
    from kvpeer.router.background import BackgroundRouter

__all__ = ["VllmArms", "router_plans", "run", "unavailable"]

COUNTERS_SETTLE_S = 5.0  # vLLM publishes kvpeer's counters with its next stats flush
HIT_SERIES = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")

Progress = Callable[[str], None]


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
    trace: bool = False
    engine_args: tuple[str, ...] = ()  # added to every engine's command line
    step_tokens: int | None = None  # the engines' step budget (None: vLLM's), told to routers
    ahead: bool = True  # the kvpeer arm pulls ahead (its tiers obey its routers' prefetches)
    #: every engine's tier peer id (host:port) -> its name, for trace timelines
    peer_names: dict[str, str] = field(default_factory=dict)

    def _step(self) -> int:
        from kvpeer.router.config import ENGINE_STEP_TOKENS

        return ENGINE_STEP_TOKENS if self.step_tokens is None else self.step_tokens

    @contextlib.contextmanager
    def __call__(self, arm: str) -> Iterator[ArmFleet]:
        from kvpeer.lab.engines.scenario import HOST
        from kvpeer.lab.engines.serving import EngineFailed, ServeFleet, ServeSpec
        from kvpeer.router.background import BackgroundRouter
        from kvpeer.router.config import EngineEntry, RouterConfig
        from kvpeer.router.policy import Mode, Role

        reason = unavailable(arm, self.data_plane)
        if reason is not None:
            raise ArmUnavailable(reason)
        # kvpeer's tiers as the README starts them: held blocks and pulling ahead are
        # their defaults (a quarter of the CPU tier held; the routers, in this process,
        # obeyed from loopback); --no-ahead turns pulling ahead off.
        options: dict[str, object] = {}
        if ARM_TIERS[arm] == "kvpeer" and not self.ahead:
            options["prefetch_from"] = []
        specs = [
            ServeSpec(name, self.model, tier=ARM_TIERS[arm],  # type: ignore[arg-type]
                      data_plane=self.data_plane, cpu_bytes=self.cpu_bytes,
                      env={TRACE_ENV: "1"} if self.trace else {}, extra_args=self.engine_args,
                      tier_options=options)
            for name in ENGINES
        ]
        self.peer_names.update({f"{HOST}:{s.tier_port}": s.name for s in specs})
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
                listen_port=0, allow_pinning=True,
                engine_step_tokens=self._step(), policy=ARM_POLICIES[arm],
            ))  # fmt: skip
            pd: BackgroundRouter | None = None
            try:
                if arm in PINNED_ARMS:  # the pinned pd workload's router
                    pd = BackgroundRouter(RouterConfig(
                        Mode.PD, (EngineEntry(a.router_engine(Role.PREFILL)),
                                  EngineEntry(b.router_engine(Role.DECODE))),
                        listen_port=0,
                        engine_step_tokens=self._step(),
                    ))  # fmt: skip
                groups = [engine.process.pid for engine in fleet.engines.values()]
                live = _LiveArm(shared, pd, [s.url for s in specs], ARM_TIERS[arm] == "kvpeer",
                                groups)  # fmt: skip
                self.progress(f"arm {arm}: warm-up (each engine computes, pulls, and pd once)")
                live.warm_up()
                yield live
            finally:
                if pd is not None:
                    pd.stop()
                shared.stop()
        finally:
            fleet.close()


@dataclass
class _LiveArm:
    shared: BackgroundRouter
    pd: BackgroundRouter | None  # only for arms that run the pinned workloads
    engine_urls: list[str]
    has_kvpeer: bool
    engine_groups: list[int]  # each engine's process group (its server's pid)

    @property
    def urls(self) -> Mapping[str, str]:
        urls = {"shared": self.shared.url}
        if self.pd is not None:
            urls["pd"] = self.pd.url
        return urls

    def warm_up(self) -> None:
        """Each engine's first requests are slow (and not learned from by the router):
        each computes a prompt directly, then pulls one from the other, then one PD pair."""
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
        if self.pd is not None:
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

    def fleet_counters(self) -> FleetCounters:
        from kvpeer.lab.engines.serving import vllm_samples

        local = external = 0.0
        for url in self.engine_urls:
            samples = vllm_samples(url, HIT_SERIES)
            local += samples.get("vllm:prefix_cache_hits_total", 0.0)
            external += samples.get("vllm:external_prefix_cache_hits_total", 0.0)

        from kvpeer.lab.engines.procs import group_cpu_seconds

        cpu = sum(group_cpu_seconds(pgid) for pgid in self.engine_groups)
        return FleetCounters(local, external, router_plans(self.shared), cpu)

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
                try:
                    indexed = self.shared.call(known)
                except TimeoutError:  # the router's thread starved (vLLM p2p engines spin)
                    indexed = 0
                if indexed >= full - BLOCK_TOKENS:
                    break
                time.sleep(0.05)


def router_plans(router: BackgroundRouter) -> tuple[tuple[str, float], ...]:
    """The router's plans so far by reason (a load-only router's are all ``load only``)."""
    from kvpeer.router.loadonly import LoadOnlyPolicy

    def plans() -> dict[str, float]:
        policy = router.router.policy
        if isinstance(policy, LoadOnlyPolicy):
            return {"load only": float(policy.statistics().plans)}
        stats = getattr(policy, "stats", None)
        found: dict[str, float] = stats() if stats is not None else {}
        return {key.split(":", 1)[1]: value for key, value in found.items()
                if key.startswith("plans_by_reason:")}  # fmt: skip

    return tuple(sorted(router.call(plans).items()))


def _read_counters(urls: Sequence[str]) -> PeerCounters:
    from kvpeer.lab.engines.serving import kvpeer_samples

    blocks = bytes_ = failed = pulls = 0.0
    for url in urls:
        samples = kvpeer_samples(url)
        blocks += samples.get("pulled_blocks_total", 0.0)
        bytes_ += samples.get("pulled_bytes_total", 0.0)
        failed += samples.get("fetches_total[failed]", 0.0)
        pulls += samples.get("fetches_total[ok]", 0.0)
    return PeerCounters(blocks, bytes_, failed, pulls)


def run(
    spec: ServeBenchSpec,
    *,
    model_dir: Path,
    log_dir: Path | None,
    progress: Progress,
) -> BenchResult:
    """The real benchmark: says at once which arms cannot run, then runs the matrix."""
    from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama

    for arm in spec.arms:
        reason = unavailable(arm, spec.data_plane)
        if reason is not None:
            progress(f"arm {arm} cannot run here, the others will: {reason}")
    progress(f"model: {model_dir} (created on first use)")
    model = ensure_llama(model_dir, SERVE_LLAMA_CONFIG)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-bench-serve-"))
    arms = VllmArms(model, logs, spec.data_plane, spec.cpu_bytes(), progress, spec.trace,
                    spec.engine_args(), spec.step_tokens, ahead=spec.ahead)
    tokenizer = None
    if "prefix" in spec.workloads:
        from vllm.tokenizers import get_tokenizer

        tokenizer = get_tokenizer(str(model))
    if not spec.trace:
        result = run_matrix(spec, arms, progress, tokenizer=tokenizer)
    else:
        slowest = Slowest("kvpeer")
        capture = RouterCapture().install()
        try:
            result = run_matrix(spec, arms, progress, slowest, tokenizer=tokenizer)
        finally:
            capture.remove()
        events = capture.events() + read_logs(sorted((logs / slowest.arm).glob("*.log")))
        result = replace(result, timelines=slowest.timelines(events, arms.peer_names))
    if log_dir is None and result.ok and not spec.trace:
        shutil.rmtree(logs, ignore_errors=True)
        return result
    return replace(result, logs=str(logs))
