"""How fast ``vllm serve`` engines answer ``/health`` under light chat load, per tier.

``python -m kvpeer.lab.bench.health_probe [--arms kvpeer,none] [--seconds 60] [--rate 0.5]``

Per arm (the tier every engine runs: ``kvpeer`` or ``none``), two fresh engines behind a
``shared`` :class:`~kvpeer.router.background.BackgroundRouter` with the router's default
health settings and, as the README's ``kvpeer router`` command shows, no replay endpoint
in its engine entries. A seeded chat workload (multi-turn, placed by the router) runs at
``--rate`` requests/s while one thread per engine times ``GET /health`` every
``--every`` seconds (its own timeout: 5 s, so a slow answer is measured, not cut). The
table gives, per arm and engine: probes, median, p99 and max answer time, answers over
the router's timeout, and what the router judged (restarts, flaps). With ``--spy``, the
first few probes still unanswered after ``--spy-after`` seconds trigger a ``py-spy
dump`` of that engine's API server and EngineCore while the probe waits (in the log
directory), and every slow probe is listed with what the API server's main thread did
meanwhile (on a CPU, or runnable and waiting for one: /proc schedstat) and which
threads of the two processes ran most.

Both arms run in one invocation on the same machine, one after the other, so their
numbers are comparable only as far as the machine's load stayed the same: the load
average at each arm's start and end is printed with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvpeer.lab.bench.serve_client import run_phase
from kvpeer.lab.bench.serve_workloads import Shape, build

__all__ = ["ArmResult", "main", "probe_arm"]

PROBE_TIMEOUT_S = 5.0
CHAT = Shape(
    requests=30, rate=0.5, prompt_tokens=1536, suffix_tokens=128, output_tokens=16,
    turns=3, background_tokens=1536, think_s=1.0,
)  # fmt: skip


@dataclass
class ArmResult:
    arm: str
    times: dict[str, list[float]] = field(default_factory=dict)  # engine -> answer times
    failed: dict[str, int] = field(default_factory=dict)  # no answer within PROBE_TIMEOUT_S
    restarts: float = 0.0
    flaps: float = 0.0
    requests: int = 0
    errors: int = 0
    load: tuple[float, float] = (0.0, 0.0)  # 1-min load average at start, at end
    dumps: list[str] = field(default_factory=list)
    slow: list[str] = field(default_factory=list)  # per slow probe: who ran meanwhile
    #: engine -> process role -> (CPU s, s runnable waiting for a CPU) over the load phase
    cpu: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)


def _time_health(url: str) -> float | None:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=PROBE_TIMEOUT_S) as reply:
            reply.read()
    except (urllib.error.URLError, OSError):
        return None
    return time.monotonic() - started


def _pids(group_leader: int) -> dict[str, int]:
    """The API server (the group's leader), its EngineCore and that one's worker."""
    parents: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append((int(entry.name), comm))
    out = {"api": group_leader}
    for role, mark, parent_role in (("core", "EngineCor", "api"), ("worker", "Worker", "core")):
        for pid, comm in parents.get(out.get(parent_role, -1), []):
            if mark in comm:  # comm is cut at 15 characters: VLLM::EngineCor
                out[role] = pid
    return out


def _threads(pids: dict[str, int]) -> dict[tuple[str, str], tuple[int, int]]:
    """(process role, thread name) -> (ns on CPU, ns runnable but waiting for a CPU),
    summed over same-named threads, from /proc/<pid>/task/*/schedstat."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for role, pid in pids.items():
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
                comm = (task / "comm").read_text().strip()
            except (OSError, ValueError):
                continue
            key = (role, "main" if task.name == str(pid) else comm)
            prev = out.get(key, (0, 0))
            out[key] = (prev[0] + int(run_ns), prev[1] + int(wait_ns))
    return out


def _by_role(before: dict[tuple[str, str], tuple[int, int]],
             after: dict[tuple[str, str], tuple[int, int]]) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for (role, thread), (run_ns, wait_ns) in after.items():
        run0, wait0 = before.get((role, thread), (0, 0))
        prev = out.get(role, (0.0, 0.0))
        out[role] = (prev[0] + (run_ns - run0) / 1e9, prev[1] + (wait_ns - wait0) / 1e9)
    return out


def _slow_row(name: str, took: float | None,
              before: dict[tuple[str, str], tuple[int, int]],
              after: dict[tuple[str, str], tuple[int, int]]) -> str:
    """One slow probe: the API server's main thread on CPU / waiting for a CPU during it,
    and the threads that ran most meanwhile (ms)."""
    deltas = {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1])
              for k, v in after.items()}
    run_ms, wait_ms = (x / 1e6 for x in deltas.get(("api", "main"), (0, 0)))
    busiest = sorted(deltas.items(), key=lambda kv: -kv[1][0])[:4]
    top = ", ".join(f"{r}/{t} {v[0] / 1e6:.0f}" for (r, t), v in busiest)
    answer = "none" if took is None else f"{took * 1000:.0f} ms"
    return (f"{name}: answer {answer}; api main thread ran {run_ms:.0f} ms, waited for a "
            f"CPU {wait_ms:.0f} ms; most CPU: {top}")


def _spy(pids: dict[str, int], path: Path) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with path.open("w") as out:
        for role, pid in pids.items():
            out.write(f"===== {role} pid {pid}\n")
            out.flush()
            subprocess.run([spy, "dump", "--pid", str(pid)], stdout=out,
                           stderr=subprocess.STDOUT, timeout=30, check=False)


def probe_arm(arm: str, model: Path, log_dir: Path, *, seconds: float, rate: float,
              every: float, spy_after: float | None, seed: int = 0) -> ArmResult:
    from kvpeer.lab.engines.serving import ServeFleet, ServeSpec
    from kvpeer.router.background import BackgroundRouter
    from kvpeer.router.config import EngineEntry, RouterConfig
    from kvpeer.router.policy import Mode

    result = ArmResult(arm)
    specs = [ServeSpec(name, model, tier=arm) for name in ("a", "b")]  # type: ignore[arg-type]
    with ServeFleet(log_dir / arm, lambda m: print(f"[{arm}] {m}", file=sys.stderr)) as fleet:
        fleet.start(specs)
        # As the README's command: no kv_events_replay in the router's engine entries.
        entries = tuple(EngineEntry(replace(s.router_engine(), kv_events_replay=None))
                        for s in specs)
        router = BackgroundRouter(RouterConfig(Mode.SHARED, entries, listen_port=0))
        stop = threading.Event()
        dumps_left = [3]

        def probe(name: str, url: str, leader: int) -> None:
            times = result.times.setdefault(name, [])
            pids: dict[str, int] = {}
            with ThreadPoolExecutor(1) as pool:
                while not stop.is_set():
                    pids = pids or _pids(leader)
                    before = _threads(pids)
                    pending = pool.submit(_time_health, url)
                    try:
                        took = pending.result(timeout=spy_after or PROBE_TIMEOUT_S + 1)
                    except FutureTimeout:
                        if dumps_left[0] > 0:  # still waiting: what are they doing now?
                            dumps_left[0] -= 1
                            path = log_dir / f"spy-{arm}-{name}-{len(result.dumps)}.txt"
                            result.dumps.append(str(path))
                            _spy(pids, path)
                        took = pending.result()
                    if took is None:
                        result.failed[name] = result.failed.get(name, 0) + 1
                    else:
                        times.append(took)
                    if spy_after is not None and (took is None or took > spy_after):
                        result.slow.append(_slow_row(name, took, before, _threads(pids)))
                    stop.wait(every)

        threads = [threading.Thread(target=probe, args=(name, engine.spec.url,
                                                        engine.process.pid), daemon=True)
                   for name, engine in fleet.engines.items()]
        groups = {name: _pids(engine.process.pid) for name, engine in fleet.engines.items()}
        at_start = {name: _threads(pids) for name, pids in groups.items()}
        try:
            result.load = (os.getloadavg()[0], 0.0)
            for thread in threads:
                thread.start()
            shape = replace(CHAT, rate=rate, requests=max(3, int(seconds * rate)))
            workload = build("chat", shape, seed)
            requests = [replace(r, pin=None) for r in workload.main]  # the router places
            records = asyncio.run(run_phase(requests, {"shared": router.url}))
            result.requests = len(records)
            result.errors = sum(1 for r in records if r.error)
            result.load = (result.load[0], os.getloadavg()[0])
            for name, pids in groups.items():
                result.cpu[name] = _by_role(at_start[name], _threads(pids))

            def judged() -> tuple[float, float]:
                reg = router.router.registry
                return (float(reg.get_sample_value("kvpeer_router_engine_restarts_total") or 0),
                        float(reg.get_sample_value("kvpeer_router_engine_flaps_total") or 0))

            result.restarts, result.flaps = router.call(judged)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=PROBE_TIMEOUT_S + 35)
            router.stop()
    return result


def _row(arm: str, name: str, times: list[float], failed: int, limit: float) -> str:
    ms = sorted(t * 1000 for t in times)
    if not ms:
        return f"{arm:8} {name:3} {0:6} {'-':>8} {'-':>8} {'-':>8} {failed:>6}"
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    over = sum(1 for t in times if t > limit) + failed
    return (f"{arm:8} {name:3} {len(ms):6} {statistics.median(ms):8.1f} {p99:8.1f} "
            f"{ms[-1]:8.1f} {over:6}")


def main(argv: list[str] | None = None) -> int:
    from kvpeer.lab.demo_run import default_model_dir
    from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama
    from kvpeer.router.config import DEFAULT_HEALTH_TIMEOUT_S

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="kvpeer,none")
    parser.add_argument("--seconds", type=float, default=60.0, help="load phase length")
    parser.add_argument("--rate", type=float, default=0.5, help="chat requests per second")
    parser.add_argument("--every", type=float, default=0.2, help="seconds between probes")
    parser.add_argument("--spy", action="store_true", help="py-spy dump on slow answers")
    parser.add_argument("--spy-after", type=float, default=0.5)
    parser.add_argument("--log-dir", type=Path)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = ensure_llama(args.model or default_model_dir(), SERVE_LLAMA_CONFIG)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-health-probe-"))
    limit = DEFAULT_HEALTH_TIMEOUT_S
    results = [
        probe_arm(arm, model, log_dir, seconds=args.seconds, rate=args.rate, every=args.every,
                  spy_after=args.spy_after if args.spy else None)
        for arm in args.arms.split(",")
    ]
    if args.json:
        print(json.dumps([r.__dict__ for r in results]))
        return 0
    print(f"/health answer times (ms) every {args.every} s under chat at {args.rate}/s; "
          f"over = answers over {limit} s (the router's default timeout) or none in "
          f"{PROBE_TIMEOUT_S} s")
    print(f"{'arm':8} {'eng':3} {'probes':>6} {'p50':>8} {'p99':>8} {'max':>8} {'over':>6}")
    for r in results:
        for name in sorted(r.times):
            print(_row(r.arm, name, r.times[name], r.failed.get(name, 0), limit))
    for r in results:
        print(f"{r.arm}: {r.requests} requests ({r.errors} errors); router judged "
              f"{r.restarts:.0f} restarts, {r.flaps:.0f} flaps; load average "
              f"{r.load[0]:.1f} -> {r.load[1]:.1f}" + (f"; dumps {r.dumps}" if r.dumps else ""))
        for name, roles in sorted(r.cpu.items()):
            print(f"  {r.arm} {name} over the load, CPU s / s waiting for a CPU: " + ", ".join(
                f"{role} {run:.1f}/{wait:.1f}" for role, (run, wait) in sorted(roles.items())))
        for line in r.slow[:10]:
            print(f"  slow {r.arm} {line}")
    print(f"logs: {log_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
