"""Summarise py-spy's raw (collapsed) samples of ``scripts/profile_rtt.py`` taken
without ``--idle`` (only threads running): per process, the share of its running
samples in each thread, and the functions most often on the stack (inclusive) and
on top (own time)."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path


def _name(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``func (path/to/file.py)``."""
    head, _, where = frame.strip().partition(" (")
    return f"{head} ({where.rpartition(':')[0]})" if where else head


def main(path: str) -> None:
    threads: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    own: dict[str, Counter[str]] = defaultdict(Counter)
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        process = frames[0].split('"')[1][:60] if frames[0].startswith("process") else "?"
        rest = frames[1:] if frames[0].startswith("process") else frames
        if rest and rest[0].startswith("process"):  # a child: its own process frame
            process = rest[0].split('"')[1][:60]
            rest = rest[1:]
        if not rest:
            continue
        threads[process][rest[0].split(":")[-1].strip()] += count
        for name in {_name(f) for f in rest[1:]}:
            inclusive[process][name] += count
        own[process][_name(rest[-1])] += count
    for process, counts in threads.items():
        total = sum(counts.values())
        print(f"\n== {process}: {total} running samples")
        for thread, count in counts.most_common(6):
            print(f"   {count / total:6.1%}  thread {thread}")
        print("   inclusive:")
        for name, count in inclusive[process].most_common(14):
            print(f"   {count / total:6.1%}  {name}")
        print("   own:")
        for name, count in own[process].most_common(10):
            print(f"   {count / total:6.1%}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
