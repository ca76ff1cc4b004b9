"""Summarise py-spy's raw (collapsed) samples of ``scripts/profile_rtt.py``: per
process and thread, the share of samples idle (sleeping in poll/select/wait), in
socket and ZMQ calls, in the data copy, and in Python code, with the top frames."""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict

IDLE = re.compile(r"\b(poll|select|wait|_wait_for_tstate_lock|acquire|sleep|epoll)\b")
NATIVE_IO = re.compile(r"(send|recv|recv_multipart|send_multipart|get|zmq_|socket)")
COPY = re.compile(r"(memmove|copy|write_blocks|_copy|readinto)")


def frame_name(frame: str) -> str:
    return frame.split(" (")[0].strip()


def main(path: str) -> None:
    samples: dict[str, Counter[str]] = defaultdict(Counter)
    leaves: dict[str, Counter[str]] = defaultdict(Counter)
    for line in open(path, encoding="utf-8"):
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = ";".join(frames[:2]) if frames[0].startswith("process") else frames[0]
        leaf = frame_name(frames[-1])
        if IDLE.search(leaf):
            kind = "idle (poll/select/lock wait)"
        elif COPY.search(leaf):
            kind = "data copy"
        elif NATIVE_IO.search(leaf):
            kind = "socket / ZMQ call"
        else:
            kind = "Python (kvpeer, stdlib)"
        samples[thread][kind] += count
        leaves[thread][frames[-1].strip()[:110]] += count
    for thread, kinds in sorted(samples.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(kinds.values())
        if total < 50:
            continue
        print(f"\n{thread[:120]}  ({total} samples)")
        for kind, count in kinds.most_common():
            print(f"  {count / total:6.1%}  {kind}")
        busy = [(f, c) for f, c in leaves[thread].most_common() if not IDLE.search(frame_name(f))]
        for frame, count in busy[:8]:
            print(f"         {count / total:6.1%}  {frame}")


if __name__ == "__main__":
    main(sys.argv[1])
