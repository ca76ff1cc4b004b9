"""The real arms of ``kvpeer bench trace``: each arm's two fresh ``vllm serve`` engines
and router (:class:`~kvpeer.lab.bench.serve_vllm.VllmArms`, as ``bench serve`` runs
them), the window sent once per arm and turn (arms in turns: A B, A B), the engines'
counters and the machine's load average read before and after; with ``probe``, the
engines measured first in each arm's first turn (:mod:`.trace_probe`)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from kvpeer.lab.bench.serve_bench import KV_BYTES_PER_TOKEN, ArmUnavailable
from kvpeer.lab.bench.serve_client import run_phase
from kvpeer.lab.bench.trace_bench import (
    TraceBenchSpec,
    bench_requests,
    median_rows,
    reusable_tokens,
    summarise,
)

__all__ = ["run"]


def run(spec: TraceBenchSpec, *, model_dir: Path, log_dir: Path | None,
        progress: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    from kvpeer.lab.bench.serve_vllm import VllmArms, unavailable
    from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama

    fitted, requests = bench_requests(spec)
    reusable = reusable_tokens(fitted)
    progress(f"{len(requests)} requests over {requests[-1].at_s:.1f} s; "
             f"{reusable} prompt tokens reusable with an infinite cache")
    model = ensure_llama(model_dir, SERVE_LLAMA_CONFIG)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-bench-trace-"))
    # every prompt fits the CPU tier: eviction is not what this bench measures
    cpu_bytes = sum(len(r.prompt) for r in requests) * KV_BYTES_PER_TOKEN + (256 << 20)
    arms = VllmArms(model, logs, spec.data_plane, cpu_bytes, progress)
    turns: list[dict[str, Any]] = []
    not_run: dict[str, str] = {}
    probes: dict[str, Any] = {}
    started = time.monotonic()
    for turn in range(spec.repeat):
        for arm in spec.arms:
            if arm in not_run:
                continue
            reason = unavailable(arm, spec.data_plane)
            if reason is not None:
                not_run[arm] = reason
                continue
            try:
                with arms(arm) as fleet:
                    if spec.probe and turn == 0:
                        from kvpeer.lab.bench.trace_probe import ProbedArm, probe

                        progress(f"arm {arm}: probing the engines")
                        # VllmArms yields its _LiveArm, which has the engines' URLs
                        try:
                            probes[arm] = probe(cast(ProbedArm, fleet), pulls=arm == "kvpeer")
                        except RuntimeError as exc:  # a failed probe costs the probe only
                            probes[arm] = {"error": str(exc)}
                        progress(f"arm {arm}: probe {json.dumps(probes[arm])}")
                    before = fleet.fleet_counters()
                    load_before = os.getloadavg()[0]
                    progress(f"arm {arm}, turn {turn + 1}/{spec.repeat}: sending "
                             f"{len(requests)} requests")
                    records = asyncio.run(run_phase(requests, fleet.urls, sender=spec.sender))
                    time.sleep(1.5)  # vLLM's stats flush: the counters include the last
                    after = fleet.fleet_counters()
                    load_after = os.getloadavg()[0]
            except ArmUnavailable as exc:
                not_run[arm] = str(exc)
                continue
            row = summarise(arm, records, after - before, reusable, spec.slo_s)
            row["turn"] = turn
            # the machine's 1-minute load before and after: what else shared its cores
            row["loadavg_1m"] = [load_before, load_after]
            turns.append(row)
            progress(f"arm {arm}, turn {turn + 1}: p50 {row['ttft_p50_s']} s, "
                     f"p90 {row['ttft_p90_s']} s")
    rows = median_rows(turns)
    ok = not not_run and all(row["errors"] == 0 for row in rows)
    if log_dir is None and ok:
        shutil.rmtree(logs, ignore_errors=True)
    return {
        "trace": str(spec.trace), "window_start_s": spec.window_start_s,
        "window_s": spec.window_s, "time_scale": spec.time_scale,
        "requests": len(requests), "reusable_tokens": reusable, "arms": rows,
        "turns": turns, "repeat": spec.repeat, "probes": probes,
        "arms_not_run": not_run, "seconds": time.monotonic() - started, "ok": ok,
        "logs": None if log_dir is None and ok else str(logs),
    }
