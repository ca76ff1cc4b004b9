"""Where a one-block fetch's time goes: N one-block pulls, for a sampling profiler.

Runs a ``kvpeer serve`` producer (a child process) and an in-process consumer over
one data plane, pulls one block ``--pulls`` times and prints the median load time.
It also prints the CPU seconds both processes spent per pull (``/proc``): with
those above the round trip itself, the time is Python work, not waiting (issue 10's
rtt goal). For which Python work, run it under py-spy::

    pip install py-spy==0.4.1   # not a dependency of kvpeer
    py-spy record --subprocesses --threads --format raw --rate 2000 \\
        -o /tmp/rtt.raw -- .venv/bin/python scripts/profile_rtt.py --plane shm
    .venv/bin/python scripts/profile_summary.py /tmp/rtt.raw

(py-spy counts a thread blocked in ``poll``/``accept`` as running now and then, so
read its shares beside the CPU numbers.)
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from kvpeer.lab.bench.transport import _consumer, producer
from kvpeer.lab.pull import Puller
from kvpeer.node.synthetic import synthetic_key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plane", default="shm", choices=["shm", "tcp", "nixl"])
    parser.add_argument("--pulls", type=int, default=3000)
    parser.add_argument("--block-len", type=int, default=64 * 1024)
    args = parser.parse_args()
    with producer(args.plane, args.block_len, 4) as peer_id:
        node, pool = _consumer(args.plane, args.block_len, 4)
        try:
            puller = Puller(node, peer_id)
            keys, slots = [synthetic_key(0)], [0]
            for _ in range(50):  # handshake, prefault
                puller.pull(keys, slots)
            loads = []
            child = _child_pid()
            before = (_cpu_s(os.getpid()), _cpu_s(child))
            for _ in range(args.pulls):
                result = puller.pull(keys, slots)
                assert result.loaded, result
                assert result.hits == 1, result
                loads.append(result.load_s)
            ours, theirs = _cpu_s(os.getpid()) - before[0], _cpu_s(child) - before[1]
            per = 1e6 / args.pulls
            print(f"{args.plane}: {args.pulls} one-block pulls of {args.block_len} B: "
                  f"median load {statistics.median(loads) * 1e6:.0f} us; CPU per pull: "
                  f"consumer {ours * per:.0f} us, producer {theirs * per:.0f} us")  # fmt: skip
        finally:
            node.shutdown()
            pool.close()


def _child_pid() -> int:
    """The ``kvpeer serve`` child (our only child process)."""
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    return int(children[0])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` (``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
