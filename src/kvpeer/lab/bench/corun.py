"""``kvpeer bench corun``: what slows an engine's prefill when something else runs beside
it on this machine: memory bandwidth or compute.

The fleet model's CPU preset keeps a *co-run slowdown* (docs/fleet.md): two engines
prefilling at once each took about 1.98x as long as one alone, of which sharing the
machine's two cores explains 1.11x. This bench names the rest by running, beside work
of known kind, one thread that competes for one resource only:

- a *bandwidth* hog copies a 256 MiB buffer over and over (far past the last-level
  cache: every byte goes to memory and back);
- a *compute* hog multiplies two 256 x 256 float32 matrices over and over (they stay
  in the core's own cache: it competes for a core, not for memory).

Two parts, each in turns (the arms of a turn run back to back, in an order that turns):

1. *kernels*: the two hogs' own kernels, timed alone on CPU 0 and as a pair on CPUs 0
   and 1 at once (pinned): pair/alone says whether the resource is per core (about 1)
   or shared by the cores (about 2);
2. *prefill*: two ``vllm serve`` engines (no tier; the engines ``bench serve`` runs),
   ``a`` and ``b``. ``a`` computes a fresh ``prompt_tokens`` prompt alone (``b`` idle),
   beside the bandwidth hog, beside the compute hog (each hog one thread, not pinned:
   ``a``'s worker has the other core), and beside ``b`` computing a fresh prompt of its
   own sent at the same moment (*engine*: the co-run the model keeps); TTFT with vLLM's
   request sender. with-hog/alone per turn says which resource a prefill here is bound
   by; engine/alone is the co-run slowdown measured in the same run (and the later of
   the pair's two TTFTs over ``a``'s alone, as ``bench trace --probe`` takes a pair). Each arm also
   records the cores each role of the two engines used over it
   (:func:`~kvpeer.lab.bench.frontend_probe.cpu_by_role`).

Ratios are medians of per-turn ratios.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["HOGS", "CorunSpec", "Hog", "kernel_turn", "render", "run", "summarize"]

Progress = Callable[[str], None]
HOGS = ("bandwidth", "compute")
PREFILL_ARMS = ("alone", *HOGS, "engine")
HOG_WARM_S = 1.0  # a hog runs this long before the measured work starts
START_LEAD_S = 3.0  # a kernel pair starts together this long after launch (imports)
MAX_TURNS = 50

#: One hog: prints ``ready`` once set up, runs ``kind``'s kernel until SIGTERM, then prints
#: its iterations per second. With a CPU and a start time it runs ``iterations`` once from
#: then and prints seconds.
_HOG = r"""
import os, signal, sys, time
kind, cpu, start, iterations = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
import torch
torch.set_num_threads(1)
if kind == "bandwidth":
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    step = lambda: dst.copy_(src)
else:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    step = lambda: torch.mm(a, b)
step()
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print("ready", flush=True)
while time.time() < start:
    pass
began, done = time.perf_counter(), 0
while True:  # one iteration at least: a rate is never 0
    step()
    done += 1
    if stop or done == iterations:
        break
took = time.perf_counter() - began
print(took if iterations else done / took, flush=True)
"""


@dataclass(frozen=True)
class CorunSpec:
    turns: int = 4
    prompt_tokens: int = 2016
    kernel_iterations: tuple[int, int] = (40, 2500)  # bandwidth, compute: ~1 s each alone

    def __post_init__(self) -> None:
        if not 1 <= self.turns <= MAX_TURNS:
            raise ValueError(f"turns {self.turns}: must be 1..{MAX_TURNS}")
        if not 16 <= self.prompt_tokens <= 2040:
            raise ValueError(f"prompt tokens {self.prompt_tokens}: must be 16..2040 (the "
                             "model's 2,048 positions less the output)")  # fmt: skip


class Hog:
    """One hog process running until :meth:`stop` (its iterations per second)."""

    def __init__(self, kind: str) -> None:
        if kind not in HOGS:
            raise ValueError(f"hog {kind!r} is not one of {HOGS}")
        self.kind = kind
        self._process = subprocess.Popen(
            [sys.executable, "-c", _HOG, kind, "-1", "0", "0"],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != "ready":  # the rate counts from here
            self.kill()
            raise RuntimeError(f"{kind} hog did not start (exit {self._process.returncode})")

    def stop(self) -> float:
        """Stop it; its rate over its whole run (iterations per second)."""
        self._process.send_signal(signal.SIGTERM)
        out, _ = self._process.communicate(timeout=30)
        if self._process.returncode != 0 or not out.strip():
            raise RuntimeError(f"{self.kind} hog failed (exit {self._process.returncode})")
        return float(out.split()[-1])

    def kill(self) -> None:
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()


def kernel_turn(kind: str, iterations: int, cpus: Sequence[int]) -> list[float]:
    """``iterations`` of ``kind``'s kernel on each of ``cpus`` at once: seconds each."""
    start = time.time() + START_LEAD_S
    processes = [
        subprocess.Popen([sys.executable, "-c", _HOG, kind, str(cpu), str(start), str(iterations)],
                         stdout=subprocess.PIPE, text=True)
        for cpu in cpus
    ]  # fmt: skip
    seconds = []
    for process in processes:
        out, _ = process.communicate(timeout=300)
        if process.returncode != 0 or not out.strip():
            raise RuntimeError(f"{kind} kernel failed (exit {process.returncode})")
        seconds.append(float(out.split()[-1]))
    return seconds


def _kernels(spec: CorunSpec, progress: Progress) -> dict[str, list[dict[str, Any]]]:
    turns: dict[str, list[dict[str, Any]]] = {kind: [] for kind in HOGS}
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        progress("kernels: CPUs 0 and 1 are not both ours: skipped")
        return turns
    for turn in range(spec.turns):
        for kind, iterations in zip(HOGS, spec.kernel_iterations, strict=True):
            arms = [("alone", [0]), ("pair", [0, 1])]
            if turn % 2:
                arms.reverse()
            got = {name: kernel_turn(kind, iterations, cpus) for name, cpus in arms}
            turns[kind].append({"alone_s": got["alone"][0], "pair_s": got["pair"]})
            pair = "/".join(f"{s:.3f}" for s in got["pair"])
            progress(f"kernels turn {turn + 1}/{spec.turns} {kind}: alone "
                     f"{got['alone'][0]:.3f} s, pair {pair} s")  # fmt: skip
    return turns


def run(spec: CorunSpec, model_dir: Path, progress: Progress,
        log_dir: Path | None = None) -> dict[str, Any]:  # fmt: skip
    from kvpeer.lab.bench.frontend_probe import cpu_by_role
    from kvpeer.lab.bench.serve_client import run_phase
    from kvpeer.lab.bench.serve_workloads import VOCAB, BenchRequest
    from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama
    from kvpeer.lab.engines.serving import ServeFleet, ServeSpec

    kernels = _kernels(spec, progress)
    model = ensure_llama(model_dir, SERVE_LLAMA_CONFIG)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-bench-corun-"))
    rng = random.Random(20261208)
    a, b = ServeSpec("a", model, tier="none"), ServeSpec("b", model, tier="none")
    prefill: list[dict[str, Any]] = []
    fleet = ServeFleet(logs, progress)
    ok = False

    def ttft(urls: Sequence[str]) -> list[float]:
        """Fresh prompts sent to ``urls`` at once: their TTFTs."""

        async def send() -> list[Any]:
            return await asyncio.gather(*(
                run_phase([BenchRequest(0.0, tuple(rng.randrange(*VOCAB)
                                                   for _ in range(spec.prompt_tokens)), 1)],
                          {"shared": url}, sender="vllm")
                for url in urls))  # fmt: skip

        records = [record for phase in asyncio.run(send()) for record in phase]
        for record in records:
            if record.error is not None:
                raise RuntimeError(f"prefill request failed: {record.error}")
        return [float(record.ttft_s) for record in records]

    try:
        progress("starting two vllm serve engines (no tier)")
        fleet.start([a, b])
        groups = [engine.process.pid for engine in fleet.engines.values()]
        ttft([a.url, b.url])  # warm-up
        for turn in range(spec.turns):
            shift = turn % len(PREFILL_ARMS)
            order = PREFILL_ARMS[shift:] + PREFILL_ARMS[:shift]
            row: dict[str, Any] = {}
            for arm in order:
                hog = Hog(arm) if arm in HOGS else None
                try:
                    time.sleep(HOG_WARM_S if hog is not None else 0.0)
                    before, started = cpu_by_role(groups), time.monotonic()
                    got = ttft([a.url, b.url] if arm == "engine" else [a.url])
                    row[f"{arm}_s"] = got[0]
                    if arm == "engine":  # as the trace probe's pair: the later of the two
                        row["engine_later_s"] = max(got)
                    after, wall = cpu_by_role(groups), time.monotonic() - started
                    row[f"{arm}_cores"] = {role: round((after[role] - before[role]) / wall, 3)
                                           for role in after if role not in ("router",
                                                                             "sender")}  # fmt: skip
                finally:
                    if hog is not None:
                        row[f"{arm}_hog_rate"] = hog.stop()
            prefill.append(row)
            progress(f"prefill turn {turn + 1}/{spec.turns}: " + ", ".join(
                f"{arm} {row[f'{arm}_s'] * 1000:.0f} ms" for arm in PREFILL_ARMS))  # fmt: skip
        ok = True
    finally:
        fleet.close()
        if ok and log_dir is None:
            shutil.rmtree(logs, ignore_errors=True)
    return summarize(spec, kernels, prefill, os.getloadavg()[0])


def summarize(spec: CorunSpec, kernels: dict[str, list[dict[str, Any]]],
              prefill: list[dict[str, Any]], loadavg: float) -> dict[str, Any]:  # fmt: skip
    """Medians of per-turn ratios (module docstring)."""

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    kernel_ratios = {
        kind: median([statistics.mean(t["pair_s"]) / t["alone_s"] for t in turns])
        for kind, turns in kernels.items()
    }
    prefill_ratios = {
        arm: median([row[f"{arm}_s"] / row["alone_s"] for row in prefill if f"{arm}_s" in row])
        for arm in (*PREFILL_ARMS[1:], "engine_later")
    }
    return {
        "spec": asdict(spec),
        "kernels": kernels,
        "prefill": prefill,
        "kernel_pair_over_alone": kernel_ratios,
        "prefill_with_hog_over_alone": prefill_ratios,
        "prefill_alone_s": median([row["alone_s"] for row in prefill]),
        "cores_by_arm": {
            arm: {role: statistics.median(row[f"{arm}_cores"][role] for row in used)
                  for role in used[0][f"{arm}_cores"]}
            for arm in PREFILL_ARMS
            if (used := [row for row in prefill if f"{arm}_cores" in row])
        },
        "loadavg_1m": loadavg,
    }


def render(result: dict[str, Any]) -> str:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    spec = result["spec"]
    kernels, prefill = result["kernel_pair_over_alone"], result["prefill_with_hog_over_alone"]
    alone = result["prefill_alone_s"]
    lines = [
        f"kvpeer bench corun: {spec['turns']} turns, medians of per-turn ratios "
        f"(load average {result['loadavg_1m']:.2f} at the end)",
        "",
        "| work | beside a bandwidth hog | beside a compute hog | beside the other engine |",
        "|---|---:|---:|---:|",
        f"| the hog's kernel, pair on CPUs 0+1 / alone | {ratio(kernels['bandwidth'])} | "
        f"{ratio(kernels['compute'])} | - |",
        f"| a {spec['prompt_tokens']}-token prefill (alone "
        f"{'-' if alone is None else f'{alone * 1000:.0f} ms'}), beside it / alone | "
        f"{ratio(prefill['bandwidth'])} | {ratio(prefill['compute'])} | "
        f"{ratio(prefill.get('engine'))} |",
        f"| the later of the two engines' prefills / `a`'s alone | - | - | "
        f"{ratio(prefill.get('engine_later'))} |",
    ]
    cores = result.get("cores_by_arm") or {}
    if cores:
        roles = sorted({role for used in cores.values() for role in used})
        lines += ["", "cores each role used over the arm (medians of turns):", "",
                  "| arm | " + " | ".join(roles) + " |",
                  "|---|" + "---:|" * len(roles)]  # fmt: skip
        for arm, used in cores.items():
            lines.append(f"| {arm} | " + " | ".join(f"{used.get(r, 0.0):.2f}" for r in roles)
                         + " |")  # fmt: skip
    return "\n".join(lines)
