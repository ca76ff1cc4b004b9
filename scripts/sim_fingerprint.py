"""One line per seed that changes if anything a simulated world does changes: its
summary and violations, the world RNG's final state, the frames sent and dropped,
the final clock, and a hash of every control frame each node received (when, who,
from whom, the bytes). For speedups that must not change what the simulation does:
run it on the tree before and after and compare the outputs (``cmp``).

    PYTHONHASHSEED=0 PYTHONPATH=src python scripts/sim_fingerprint.py 0-299 50000-50099
"""

from __future__ import annotations

import hashlib
import sys

from kvpeer.lab.sim import sim_network
from kvpeer.lab.sim.world import World
from kvpeer.transport.base import InboundFrame


class _Recorder:
    """Wraps SimControl.receive: hashes every frame handed to a node."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self._receive = sim_network.SimControl.receive

    def receive(self, control: sim_network.SimControl) -> list[InboundFrame]:
        frames = self._receive(control)
        if frames:
            self.digest.update(repr(control._network._clock()).encode())
            self.digest.update(control.local_id.encode())
            for frame in frames:
                self.digest.update(frame.peer_id.encode())
                self.digest.update(bytes(frame.frame))
        return frames


def fingerprint(seed: int, recorder: _Recorder) -> str:
    recorder.digest = hashlib.sha256()
    world = World(seed)
    result = world.run()
    rng = hashlib.sha256(repr(world.rng.getstate()).encode()).hexdigest()[:12]
    return (
        f"{result.summary()} | {result.violations} | rng {rng} sent {world.net.frames_sent} "
        f"dropped {world.net.frames_dropped} clock {world.clock.now!r} "
        f"recv {recorder.digest.hexdigest()[:16]}"
    )


def main(ranges: list[str]) -> None:
    recorder = _Recorder()

    def receive(control: sim_network.SimControl) -> list[InboundFrame]:
        return recorder.receive(control)

    sim_network.SimControl.receive = receive  # type: ignore[method-assign,assignment]
    for text in ranges:
        first, _, last = text.partition("-")
        for seed in range(int(first), int(last or first) + 1):
            print(fingerprint(seed, recorder), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
