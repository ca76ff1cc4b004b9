"""``kvpeer bench node-scale``: one node with many live peer sessions.

The measured node (the *hub*) is ``kvpeer serve`` in a process of its own (its CPU
and memory are read from ``/proc``), with synthetic blocks preloaded. ``peers`` kvpeer
nodes in this process (no engine, ``tcp`` data plane) each open a session to it with
one lookup of every synthetic block (which must all be hits). Then:

1. **Idle.** The hub's CPU seconds and resident memory over ``idle_s`` with no
   session (before the peers connect: the baseline of the same run) and with every
   session open and idle (heartbeats only); per session = difference / sessions.
   The hub's ``kvpeer_sessions`` gauge must equal ``peers``.
2. **Lookups at once.** ``rounds`` times, every peer sends a lookup at the same moment
   (threads released by one barrier) and times it to its answer; baseline: one peer
   asking alone, ``rounds`` times, in the same run. Every lookup must be answered.

The default of 127 peers is the most a node keeps with the default ``max_peers`` of 128
(one slot left). The peers share this process and its cores with the hub, so the
latency of 127 lookups at once includes their own scheduling.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpeer.node.peertable import DEFAULT_HASH_SEED
from kvpeer.node.synthetic import synthetic_key

__all__ = ["NodeScaleSpec", "add_arguments", "render", "run"]

Progress = Callable[[str], None]
HOST = "127.0.0.1"
BLOCK_LEN = 4096
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class NodeScaleSpec:
    peers: int = 127
    idle_s: float = 10.0
    rounds: int = 5
    blocks: int = 16  # synthetic blocks each lookup asks for

    def __post_init__(self) -> None:
        if not 1 <= self.peers <= 127:
            raise ValueError(f"peers must be 1..127 (max_peers is 128), got {self.peers}")
        if self.idle_s <= 0 or self.rounds < 1 or self.blocks < 1:
            raise ValueError("idle_s, rounds and blocks must be positive")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NodeScaleSpec:
        base = cls(peers=16, idle_s=3.0, rounds=3) if args.quick else cls()
        return cls(
            peers=args.peers or base.peers,
            idle_s=args.seconds or base.idle_s,
            rounds=args.rounds or base.rounds,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, help="peer sessions to the node (default 127)")
    parser.add_argument("--seconds", type=float, help="idle seconds measured (default 10)")
    parser.add_argument("--rounds", type=int, help="rounds of lookups at once (default 5)")
    parser.add_argument("--quick", action="store_true", help="16 peers, 3 s idle")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# -- the hub ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    cpu_s: float
    rss_bytes: int


def usage(pid: int) -> Usage:
    """CPU seconds and resident bytes of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return Usage(cpu, rss)


def idle_usage(pid: int, seconds: float) -> tuple[float, int]:
    """Cores used by ``pid`` over ``seconds`` of wall time, and its RSS at the end."""
    before, started = usage(pid), time.monotonic()
    time.sleep(seconds)  # the measured interval itself
    after, wall = usage(pid), time.monotonic() - started
    return (after.cpu_s - before.cpu_s) / wall, after.rss_bytes


@contextlib.contextmanager
def hub(spec: NodeScaleSpec) -> Iterator[tuple[subprocess.Popen[bytes], int, str]]:
    """``kvpeer serve`` with synthetic blocks: (process, control port, metrics URL)."""
    with tempfile.TemporaryDirectory(prefix="kvpeer-node-scale-") as tmp:
        ready, out = Path(tmp) / "ready", Path(tmp) / "out"
        with out.open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvpeer.cli", "serve", "--port", "0", "--data-planes",
                 "tcp", "--blocks", str(spec.blocks), "--block-len", str(BLOCK_LEN),
                 "--synthetic-blocks", str(spec.blocks), "--ready-file", str(ready),
                 "--metrics-port", "0"],
                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not (ready.exists() and ready.read_text()):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvpeer serve did not start: {out.read_text()[-2000:]}")
                time.sleep(0.05)  # another process; nothing to wait on but its file
            port = int(ready.read_text().rsplit(":", 1)[1])
            match = re.search(r"metrics at (http://\S+)", out.read_text())
            if match is None:
                raise RuntimeError(f"kvpeer serve printed no metrics URL: {out.read_text()}")
            yield process, port, match[1]
        finally:
            if process.poll() is None:
                os.killpg(process.pid, 15)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, 9)
                    process.wait()


def sessions_gauge(metrics_url: str) -> int:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    match = re.search(r"^kvpeer_sessions(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    if match is None:
        raise RuntimeError("the node's metrics have no kvpeer_sessions")
    return int(float(match[1]))


# -- the peers --------------------------------------------------------------------------


@contextlib.contextmanager
def peers(count: int, blocks: int) -> Iterator[list[Any]]:
    """``count`` kvpeer nodes with no engine, on tcp."""
    from kvpeer.lab.bench.idle import consumer

    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(consumer("tcp", BLOCK_LEN, DEFAULT_HASH_SEED, blocks))
            for _ in range(count)
        ]


def lookups_at_once(nodes: Sequence[Any], port: int, keys: Sequence[bytes]) -> list[Any]:
    """Every node looks ``keys`` up at the hub at the same moment; their timings."""
    from kvpeer.lab.bench.idle import LookupTiming, lookup_once

    barrier = threading.Barrier(len(nodes))
    timings: list[LookupTiming | None] = [None] * len(nodes)

    def ask(i: int) -> None:
        barrier.wait()
        timings[i] = lookup_once(nodes[i], port, keys)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return timings


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_row(name: str, timings: Sequence[Any], blocks: int) -> dict[str, Any]:
    """One row of lookup timings: how many were answered with every block a hit."""
    answered = [t.seconds for t in timings if t is not None and t.seconds is not None]
    return {
        "case": name,
        "lookups": len(timings),
        "answered": len(answered),
        "all_hits": sum(1 for t in timings if t is not None and t.hits == blocks),
        "p50_ms": _quantile(answered, 0.5) * 1e3 if answered else None,
        "p99_ms": _quantile(answered, 0.99) * 1e3 if answered else None,
        "max_ms": max(answered) * 1e3 if answered else None,
    }


# -- the run ----------------------------------------------------------------------------


def run(spec: NodeScaleSpec, progress: Progress) -> dict[str, Any]:
    from kvpeer.lab.bench.idle import lookup_once

    keys = [synthetic_key(i) for i in range(spec.blocks)]
    with hub(spec) as (process, port, metrics_url):
        progress(f"node at port {port}; idle with no session for {spec.idle_s:g} s")
        time.sleep(1.0)  # start-up settles before the baseline
        cores_0, rss_0 = idle_usage(process.pid, spec.idle_s)
        progress(f"opening {spec.peers} sessions")
        with peers(spec.peers, spec.blocks) as nodes:
            opened = [lookup_once(node, port, keys) for node in nodes]
            live = sessions_gauge(metrics_url)
            progress(f"{live} sessions live; idle for {spec.idle_s:g} s")
            ours_before = usage(os.getpid())
            cores_n, rss_n = idle_usage(process.pid, spec.idle_s)
            ours = usage(os.getpid()).cpu_s - ours_before.cpu_s
            alone, together = [], []
            for round_ in range(spec.rounds):
                alone.append(lookup_once(nodes[0], port, keys))
                together.extend(lookups_at_once(nodes, port, keys))
                progress(f"round {round_ + 1}/{spec.rounds} of {spec.peers} lookups at once")
            live_after = sessions_gauge(metrics_url)
    return {
        "spec": asdict(spec),
        "sessions_live": live,
        "sessions_live_after": live_after,
        "opening": latency_row("opening lookup", opened, spec.blocks),
        "idle": {
            "hub_cores_0": cores_0,
            "hub_cores_n": cores_n,
            "hub_rss_0": rss_0,
            "hub_rss_n": rss_n,
            "hub_cores_per_session": (cores_n - cores_0) / spec.peers,
            "hub_bytes_per_session": (rss_n - rss_0) / spec.peers,
            "peers_cores_per_session": ours / spec.idle_s / spec.peers,
        },
        "lookups": [latency_row("one peer alone", alone, spec.blocks),
                    latency_row(f"{spec.peers} peers at once", together, spec.blocks)],
    }


def render(result: dict[str, Any]) -> str:
    s, idle = result["spec"], result["idle"]
    lines = [
        f"kvpeer bench node-scale: one node (kvpeer serve, tcp), {s['peers']} peer sessions "
        f"({result['sessions_live']} live by its kvpeer_sessions gauge, "
        f"{result['sessions_live_after']} at the end), {s['blocks']} blocks per lookup",
        f"idle over {s['idle_s']:g} s     {'cores':>8} {'RSS MiB':>8}",
        f"  no session          {idle['hub_cores_0']:8.4f} {idle['hub_rss_0'] / 2**20:8.1f}",
        f"  {s['peers']:3d} sessions        {idle['hub_cores_n']:8.4f} "
        f"{idle['hub_rss_n'] / 2**20:8.1f}",
        f"  per session         {idle['hub_cores_per_session']:8.5f} "
        f"{idle['hub_bytes_per_session'] / 1024:7.1f}K   (peer side: "
        f"{idle['peers_cores_per_session']:.5f} cores per session)",
        f"lookup -> answer      {'lookups':>8} {'answered':>8} {'all hit':>8} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'max ms':>8}",
    ]
    base = result["lookups"][0]["p50_ms"]
    for row in [result["opening"], *result["lookups"]]:
        ratio = f"  {row['p50_ms'] / base:6.1f}x p50 of alone" if base and row["p50_ms"] else ""
        lines.append(
            f"  {row['case']:19} {row['lookups']:8d} {row['answered']:8d} {row['all_hits']:8d} "
            f"{_fmt(row['p50_ms'])} {_fmt(row['p99_ms'])} {_fmt(row['max_ms'])}{ratio}"
        )
    lines.append(f"  (the peers run in this process: {s['peers']} lookups at once share its "
                 "cores with the node)")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:8.2f}"

