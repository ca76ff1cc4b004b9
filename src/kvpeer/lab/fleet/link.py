"""The network between engines: each engine's NIC sends one transfer at a time and
receives one at a time (first come, first served), at the link's rate.

Invariant: a transfer starts no earlier than it is asked for, than the source's NIC is
free, and than the destination's is; it ends ``LinkModel.transfer_s`` later, and both
NICs are busy until then. ``bytes_moved`` counts every byte sent.
"""

from __future__ import annotations

from kvpeer.lab.fleet.params import LinkModel

__all__ = ["Network"]


class Network:
    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self._egress: dict[str, float] = {}
        self._ingress: dict[str, float] = {}
        self.bytes_moved = 0
        self.transfers = 0
        self.queued_s = 0.0  # time transfers waited for a busy NIC

    def transfer(self, source: str, destination: str, size: int, now: float) -> float:
        """When ``size`` bytes asked for at ``now`` have arrived."""
        start = max(now, self._egress.get(source, 0.0), self._ingress.get(destination, 0.0))
        end = start + self.link.transfer_s(size)
        self._egress[source] = self._ingress[destination] = end
        self.bytes_moved += size
        self.transfers += 1
        self.queued_s += start - now
        return end
