"""Drive ``kvpeer soak`` (see :mod:`kvpeer.lab.bench.soak_verdict` for what is judged and why).

Two ``vllm serve`` engines (``a``, ``b``; kvpeer tier over shm) behind two routers run on
threads of this process: ``pd`` (``a`` prefills, ``b`` pulls and decodes) and ``shared``
(both serve whole requests; the router names a peer holding the prompt's prefix). Two
client threads send streamed greedy requests through the routers' OpenAI API without
pause: PD requests of fresh prompts, and shared requests whose 384-token prefix comes
from a small rotating set of *families* (a new family now and then) with a fresh suffix,
pinned to a random engine, so an engine keeps meeting prefixes its peer computed (and a
restarted ``b`` re-learns them from ``a``). The main thread injects the seeded faults.

**References.** Every prompt is new, so each request's reference is computed once, right
after it: the same prompt sent straight to an engine (no router, so no peer is named)
with a fresh ``cache_salt`` (so it shares no block with anything cached), i.e. computed
from scratch. ``a`` computes it, or ``b`` while ``a`` is frozen or busy failing. An
output must equal its reference token for token; a stream that ends early is a failure,
not a mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpeer.host.claims import CLAIM_PREFIX
from kvpeer.lab.bench.routerproc import RouterProcess
from kvpeer.lab.bench.soak_events import SOAK_EVENT_BUFFER_STEPS, event_history
from kvpeer.lab.bench.soak_memory import MemoryTrace, router_index
from kvpeer.lab.bench.soak_verdict import (
    DRIVER,
    ENGINES,
    FAULT_GRACE_S,
    QUIET_S,
    ROUTERS,
    WARMUP_FAULT,
    WARMUP_TRAFFIC_S,
    Fault,
    Outcome,
    Sample,
    SoakSpec,
    Tally,
    compare_processes,
    render,
    schedule,
    summary,
)
from kvpeer.lab.engines.procs import (
    ProcessInfo,
    group_pids,
    process_info,
    shm_in_use,
    shm_names,
)

__all__ = ["main", "run"]

MODEL_NAME = "kvpeer-demo"
PROMPT_TOKENS = 512  # ~0.3 s to compute on serve-llama here; a few ms to pull
PREFIX_TOKENS = 384
FAMILIES = 4  # shared prefixes in rotation
NEW_FAMILY_P = 0.15  # chance a shared request starts a new family
OUT_TOKENS = 4
VOCAB = (3, 512)
PROGRESS_S = 30.0
REFERENCE_ATTEMPTS = 6
HEALTHY_TIMEOUT_S = 60.0
# The routers' /health timeout: two engines computing on two shared cores answer /health
# in over a second at times, and the default (1 s) then routes around a healthy engine.
HEALTH_TIMEOUT_S = 5.0
PIN_HEADER = "X-Kvpeer-Engine"
FAILED_PAUSE_S = 0.5  # after a failed request (an engine down fails at once): no hammering
Progress = Callable[[str], None]


class Soak:
    """One soak: fleet, routers, traffic threads, faults, samples."""

    def __init__(self, spec: SoakSpec, fleet: Any, progress: Progress) -> None:
        self.spec = spec
        self.fleet = fleet
        self.progress = progress
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.tally = Tally()
        self.windows: list[tuple[float, float]] = []
        self.faults: list[dict[str, Any]] = []
        self.restarted: set[str] = set()
        self.pulled: dict[str, tuple[int, float]] = {}  # engine -> (incarnation pid, last)
        self.pulled_total = 0.0
        self.urls: dict[str, str] = {}
        self.routers: dict[str, RouterProcess] = {}
        self.replay: dict[str, str] = {}  # engine -> its KV-event replay endpoint
        self.event_history: dict[str, dict[str, Any]] = {}  # engine -> when -> counts
        self.memory = MemoryTrace(enabled=spec.trace_memory)
        self.router_index: dict[str, dict[str, dict[str, int]]] = {}  # router -> when -> held
        self.warmup_faults: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- traffic ---------------------------------------------------------------------

    def clients(self, router: str) -> tuple[Any, dict[str, Any]]:
        from kvpeer.lab.engines.openai_client import OpenAIClient

        direct = {
            name: OpenAIClient(e.spec.url, MODEL_NAME, 120.0)
            for name, e in self.fleet.engines.items()
        }
        return OpenAIClient(self.urls[router], MODEL_NAME, 120.0), direct

    def reference(self, direct: dict[str, Any], prompt: list[int]) -> list[int]:
        """``prompt`` computed from scratch by one engine (see the module docstring)."""
        error: Exception | None = None
        for attempt in range(REFERENCE_ATTEMPTS):
            name = ENGINES[attempt % 2]
            try:
                salt = {"cache_salt": uuid.uuid4().hex}
                tokens: list[int] = direct[name].complete(prompt, OUT_TOKENS, extra=salt).tokens
                if len(tokens) == OUT_TOKENS:
                    return tokens
                error = RuntimeError(f"reference on {name}: {len(tokens)} tokens")
            except Exception as exc:  # an engine down or frozen: the other one
                error = exc
            if attempt % 2:
                self.stop.wait(2.0)  # both failed: let a restart or a thaw proceed
        raise RuntimeError(f"no reference after {REFERENCE_ATTEMPTS} attempts: {error}")

    def request(
        self,
        kind: str,
        via: Any,
        direct: dict[str, Any],
        prompt: list[int],
        headers: dict[str, str] | None,
        named_header: str,
    ) -> Outcome:
        started = self.now()
        try:
            completion = via.complete(prompt, OUT_TOKENS, headers)
            if len(completion.tokens) != OUT_TOKENS:
                raise RuntimeError(f"stream ended after {len(completion.tokens)} tokens")
        except Exception as exc:
            return Outcome(kind, started, f"{type(exc).__name__}: {exc}", self.now())
        try:
            want = self.reference(direct, prompt)
        except RuntimeError as exc:
            return Outcome(kind, started, str(exc), self.now())
        return Outcome(
            kind,
            started,
            matched=completion.tokens == want,
            named_peer=kind == "pd" or named_header in completion.headers,
            cached=completion.cached_tokens,
        )

    def record(self, outcome: Outcome) -> None:
        with self.lock:
            label = self.tally.add(outcome, self.windows)
        if label == "mismatch":
            self.progress(f"MISMATCH: {outcome.kind} request at {outcome.started_s:.1f} s")
        elif label == "failed":
            self.stop.wait(FAILED_PAUSE_S)

    def pd_traffic(self, seed: int) -> None:
        rng = random.Random(seed)
        via, direct = self.clients("pd")
        try:
            while not self.stop.is_set():
                prompt = fresh(rng, PROMPT_TOKENS)
                outcome = self.request("pd", via, direct, prompt, None, "x-kvpeer-prefill-seconds")
                self.record(outcome)
        finally:
            for client in (via, *direct.values()):
                client.close()

    def shared_traffic(self, seed: int) -> None:
        rng = random.Random(seed)
        families = [fresh(rng, PREFIX_TOKENS) for _ in range(FAMILIES)]
        via, direct = self.clients("shared")
        try:
            while not self.stop.is_set():
                if rng.random() < NEW_FAMILY_P:
                    families[rng.randrange(FAMILIES)] = fresh(rng, PREFIX_TOKENS)
                prompt = rng.choice(families) + fresh(rng, PROMPT_TOKENS - PREFIX_TOKENS)
                pin = {PIN_HEADER: rng.choice(ENGINES)}
                outcome = self.request("shared", via, direct, prompt, pin, "x-kvpeer-source")
                self.record(outcome)
        finally:
            for client in (via, *direct.values()):
                client.close()

    # -- faults ----------------------------------------------------------------------

    def inject(self, fault: Fault) -> None:
        engine = self.fleet.engines[fault.engine]
        self.count_pulls()  # what this incarnation pulled, before it may be gone
        start = self.now()
        with self.lock:
            self.windows.append((start, float("inf")))
            index = len(self.windows) - 1
        if fault.kind == "kill-restart":
            engine.signal(signal.SIGKILL)
            engine.wait_gone()
            self.fleet.restart(fault.engine)
            self.restarted.add(fault.engine)
        elif fault.kind == "restart":
            self.fleet.restart(fault.engine)
            self.restarted.add(fault.engine)
        else:
            engine.signal(signal.SIGSTOP)
            try:
                self.stop.wait(fault.freeze_s)
            finally:
                engine.signal(signal.SIGCONT)
        self.wait_healthy(fault.engine)
        end = self.now()
        with self.lock:
            self.windows[index] = (start, end + FAULT_GRACE_S)
        self.faults.append(
            {
                "kind": fault.kind,
                "engine": fault.engine,
                "at_s": round(start, 1),
                "seconds": round(end - start, 1),
                "freeze_s": fault.freeze_s,
            }
        )
        self.progress(
            f"fault {len(self.faults)}: {fault.kind} on {fault.engine}"
            + (f" for {fault.freeze_s:.1f} s" if fault.kind == "freeze" else "")
            + f"; serving again after {end - start:.1f} s"
        )

    def wait_healthy(self, name: str) -> None:
        deadline = time.monotonic() + HEALTHY_TIMEOUT_S
        while not self.fleet.engines[name].healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {name} not healthy {HEALTHY_TIMEOUT_S:.0f} s after")
            time.sleep(0.2)

    # -- observation -----------------------------------------------------------------

    def sample_processes(self) -> list[Sample]:
        out: list[Sample] = []
        me = process_info(os.getpid())
        if me is not None:
            out.append((DRIVER, *_memory(me)))
        for name, router in sorted(self.routers.items()):
            info = process_info(router.pid) if router.pid is not None else None
            if info is not None:
                out.append((f"router-{name}", *_memory(info)))
        for name, engine in sorted(self.fleet.engines.items()):
            for pid in group_pids(engine.process.pid):
                info = process_info(pid)
                if info is not None:
                    out.append((f"{name}:{info.name}", *_memory(info)))
        return out

    def count_pulls(self) -> None:
        """Blocks pulled, from each engine's ``vllm:kvpeer_pulled_blocks_total``, read
        every progress report and before each fault (a new incarnation starts from zero;
        what one pulled between its last scrape and a SIGKILL or SIGTERM is not seen)."""
        from kvpeer.lab.engines.serving import kvpeer_samples

        for name, engine in list(self.fleet.engines.items()):
            try:
                value = kvpeer_samples(engine.spec.url).get("pulled_blocks_total", 0.0)
            except Exception:
                continue  # down or frozen: counted at the next scrape
            with self.lock:  # the reporter and the fault injector both count
                pid, last = self.pulled.get(name, (engine.process.pid, 0.0))
                same = pid == engine.process.pid and value >= last
                self.pulled_total += value - last if same else value
                self.pulled[name] = (engine.process.pid, value)

    def report(self) -> None:
        self.count_pulls()
        with self.lock:
            t = self.tally
            counts = (t.total("ok"), t.total("fallback"), t.total("failed"), t.total("mismatch"))
        groups: dict[str, tuple[int, int]] = {}
        for label, _pid, _started, anon, _file, _shm, fds in self.sample_processes():
            group = label.split(":", 1)[0]
            old = groups.get(group, (0, 0))
            groups[group] = (old[0] + anon, old[1] + fds)
        resources = ", ".join(
            f"{g} {anon / (1 << 20):.0f} MiB anon {fds} fds" for g, (anon, fds) in groups.items()
        )
        self.progress(
            f"{self.now():.0f} s: requests ok {counts[0]}, fallback {counts[1]}, failed "
            f"{counts[2]}, mismatch {counts[3]}; faults {len(self.faults)}; pulled blocks "
            f"{self.pulled_total:.0f}; {resources}; {self.index_line()}"
        )

    def router_indexes(self) -> dict[str, dict[str, int]]:
        """Each router's prefix index (blocks per engine and medium, hash mappings)."""
        return {router: router_index(url + "/metrics") for router, url in sorted(self.urls.items())}

    def index_line(self) -> str:
        return "; ".join(
            f"{router} index " + " ".join(f"{k} {v}" for k, v in held.items())
            for router, held in self.router_indexes().items()
        )

    def reporter(self) -> None:
        while not self.stop.wait(PROGRESS_S):
            with contextlib.suppress(Exception):  # a report must never end the soak
                self.report()

    # -- the run ---------------------------------------------------------------------

    def warm_up(self) -> None:
        """Every path once, with no fault: each engine computes, PD pulls, and shared
        prompts computed by one engine are served by the other (once its KV events
        reached the router), both ways."""
        rng = random.Random(self.spec.seed + 7)
        via_pd, direct = self.clients("pd")
        via_shared, _unused = self.clients("shared")
        try:
            for name in ENGINES:
                salt = {"cache_salt": uuid.uuid4().hex}
                direct[name].complete(fresh(rng, PROMPT_TOKENS), OUT_TOKENS, extra=salt)
            for first, second in (("a", "b"), ("b", "a")):
                prompt = fresh(rng, PROMPT_TOKENS)
                via_shared.complete(prompt, OUT_TOKENS, {PIN_HEADER: first})
                via_pd.complete(fresh(rng, PROMPT_TOKENS), OUT_TOKENS)  # meanwhile: events
                via_shared.complete(prompt, OUT_TOKENS, {PIN_HEADER: second})
        finally:
            for client in (via_pd, via_shared, *direct.values(), *_unused.values()):
                client.close()

    def traffic(self, phase: int) -> list[threading.Thread]:
        """Start the client threads (and the progress reports) of one phase."""
        self.stop.clear()
        seed = self.spec.seed * 100 + phase * 10
        threads = [
            threading.Thread(target=self.pd_traffic, args=(seed + 1,), name="soak-pd"),
            threading.Thread(target=self.shared_traffic, args=(seed + 2,), name="soak-shared"),
            threading.Thread(target=self.reporter, name="soak-progress"),
        ]
        for thread in threads:
            thread.daemon = True
            thread.start()
        return threads

    def pause(self, threads: list[threading.Thread]) -> None:
        """Stop the phase's threads; each finishes the request it is in."""
        self.stop.set()
        for thread in threads:
            thread.join()

    def run(self) -> tuple[list[Sample], list[Sample]]:
        self.memory.start()
        self.progress("warm-up: every path once, no fault")
        self.warm_up()
        self.progress(
            f"warm-up: {WARMUP_TRAFFIC_S:.0f} s of the soak's traffic, a {WARMUP_FAULT.kind} "
            f"of {WARMUP_FAULT.engine}, {WARMUP_TRAFFIC_S:.0f} s more"
        )
        threads = self.traffic(0)
        time.sleep(WARMUP_TRAFFIC_S)  # the phase's length: traffic runs meanwhile
        self.inject(WARMUP_FAULT)  # failure paths once; the routers relearn the new engine
        time.sleep(WARMUP_TRAFFIC_S)
        self.pause(threads)
        for name in ENGINES:
            self.wait_healthy(name)
        self.count_pulls()
        time.sleep(QUIET_S)  # pooled connections lapse (see QUIET_S)
        release_free_heap()
        before = self.sample_processes()
        self.sample_event_history("before")
        self.sample_router_index("before")
        self.memory.mark()
        warm, self.tally = self.tally, Tally()
        # The warm-up's fault is not the soak's: its window, its log and its restart (the
        # engine sampled now is the restarted one) start over.
        self.warmup_faults, self.faults = self.faults, []
        self.windows, self.restarted = [], set()
        served = warm.total("ok") + warm.total("fallback")
        self.progress(
            f"warm-up served {served} requests ({warm.total('mismatch')} mismatched, "
            f"{warm.total('failed')} failed); soak: {self.spec.minutes:g} min of traffic, "
            f"a fault every ~{self.spec.fault_every_s:g} s (seed {self.spec.seed})"
        )
        self.t0 = time.monotonic()
        threads = self.traffic(1)
        try:
            for fault in schedule(self.spec.seed, self.spec.fault_every_s):
                if self.now() + fault.gap_s >= self.spec.seconds:
                    break
                time.sleep(fault.gap_s)  # the schedule's gap: traffic runs meanwhile
                self.inject(fault)
            remaining = self.spec.seconds - self.now()
            if remaining > 0:
                time.sleep(remaining)
        finally:
            self.pause(threads)
        for name in ENGINES:
            self.wait_healthy(name)
        self.report()
        time.sleep(QUIET_S)
        release_free_heap()
        # The warm-up's failures outside its fault and its mismatches count like the soak's.
        for kind, by_class in warm.counts.items():
            self.tally.counts[f"{kind} warm-up"] = by_class
        self.tally.unexplained[:0] = [f"warm-up {u}" for u in warm.unexplained]
        after = self.sample_processes()
        self.sample_event_history("after")
        self.sample_router_index("after")
        self.memory.compare(self.progress)
        return before, after

    def sample_router_index(self, when: str) -> None:
        for router, held in self.router_indexes().items():
            self.router_index.setdefault(router, {})[when] = held

    def sample_event_history(self, when: str) -> None:
        """What each engine's vLLM event publisher holds for replay
        (kvpeer.lab.bench.soak_events)."""
        for name, endpoint in self.replay.items():
            history = event_history(endpoint)
            self.event_history.setdefault(name, {})[when] = (
                None if history is None else asdict(history)
            )
            self.progress(
                f"{name}'s KV-event replay buffer ({when}): "
                + (
                    "no complete answer"
                    if history is None
                    else f"{history.batches} batches, {history.payload_bytes / 2**20:.1f} MiB"
                )
            )


def release_free_heap() -> bool:
    """Collect garbage, then give the C heap's free pages back (glibc ``malloc_trim``), so
    that the driver's RSS is what it holds, not how fragmented its heap is; False where
    there is no glibc. Live memory stays: a leak still shows."""
    gc.collect()
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def run(spec: SoakSpec, model: Path, log_dir: Path, progress: Progress) -> dict[str, Any]:
    """The whole soak; the engines are stopped whatever happens."""
    from kvpeer.lab.engines.serving import ServeFleet, ServeSpec
    from kvpeer.router.policy import Mode, Role

    started = time.monotonic()
    shm_at_start = shm_names()
    specs = [
        ServeSpec(name, model, data_plane="shm", event_buffer_steps=SOAK_EVENT_BUFFER_STEPS)
        for name in ENGINES
    ]
    a, b = specs
    fleet = ServeFleet(log_dir, progress)
    soak = Soak(spec, fleet, progress)
    try:
        fleet.start(specs)
        routers = {
            "shared": RouterProcess(
                "shared", Mode.SHARED, (a.router_engine(), b.router_engine()), log_dir,
                allow_pinning=True, health_timeout_s=HEALTH_TIMEOUT_S,
            ),
            "pd": RouterProcess(
                "pd", Mode.PD, (a.router_engine(Role.PREFILL), b.router_engine(Role.DECODE)),
                log_dir, health_timeout_s=HEALTH_TIMEOUT_S,
            ),
        }  # fmt: skip
        soak.routers = routers
        with contextlib.ExitStack() as stack:
            for name in ROUTERS:
                progress(f"starting kvpeer router ({name})")
                soak.urls[name] = stack.enter_context(routers[name]).url
            soak.replay = {s.name: f"tcp://127.0.0.1:{s.replay_port}" for s in specs}
            before, after = soak.run()
    finally:
        fleet.close()
    engine_ids = [s.engine_id for s in specs]
    ours = [p.name for p in fleet.removed if p.name.startswith(("vllm_offload_", CLAIM_PREFIX))]
    in_use = shm_in_use()
    leftovers = sorted(n for n in shm_names() - shm_at_start if n not in in_use)
    leftovers += [n for n in sorted(shm_names()) if any(i in n for i in engine_ids)]
    leftovers += [f"{n} (removed by the fleet by name)" for n in ours]
    rows = compare_processes(before, after, soak.restarted)
    return summary(
        spec=spec,
        tally=soak.tally,
        rows=rows,
        faults=soak.faults,
        warmup_faults=soak.warmup_faults,
        pulled_blocks=soak.pulled_total,
        leftovers=sorted(set(leftovers)),
        removed_by_fleet=[p.name for p in fleet.removed if p.name not in ours],
        seconds=time.monotonic() - started,
        logs=[],
        event_history=soak.event_history,
    ) | {"router_index": soak.router_index} | (
        {"memory_growth": soak.memory.growth} if spec.trace_memory else {}
    )


def main(args: argparse.Namespace) -> int:
    """``kvpeer soak``: run, print the summary (or JSON); 1 if a check failed."""
    from kvpeer.lab.demo_run import default_model_dir
    from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama

    def progress(message: str) -> None:
        print(f"kvpeer soak: {message}", file=sys.stderr, flush=True)

    spec = SoakSpec.from_args(args)
    model = ensure_llama(
        args.model or default_model_dir(os.environ.get("XDG_CACHE_HOME")), SERVE_LLAMA_CONFIG
    )
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvpeer-soak-"))
    try:
        result = run(spec, model, log_dir, progress)
    except Exception as exc:
        progress(f"FAILED: {type(exc).__name__}: {exc}; engine logs in {log_dir}")
        return 1
    if result["ok"] and not args.log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        result["logs"] = [str(log_dir)]
    print(json.dumps(result) if args.json else render(result))
    return 0 if result["ok"] else 1


def _memory(info: ProcessInfo) -> tuple[int, int, int, int, int, int]:
    """A sample's fields after its label: pid, start, anonymous, file and shm RSS, fds."""
    return (info.pid, info.started, info.anon_bytes, info.file_bytes, info.shmem_bytes,
            info.fds)  # fmt: skip
