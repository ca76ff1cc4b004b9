"""A network namespace behind a veth pair, made (and removed) by the test itself.

:func:`veth_namespace` creates, under names that carry this process's pid, a
namespace ``kvpeer-test-<pid>-<n>``, a veth pair whose *outside* end stays in the
root namespace and whose *inside* end moves into the namespace, and a private
``10.213.0.0/16`` /30 on the pair (outside ``.1``, inside ``.2``). Nothing else is
routed: the /30 is also covered by a high-metric ``blackhole`` route, so if the
pair's own route ever goes away (a link taken down, the pair deleted) traffic for
those addresses is dropped here rather than sent toward the default gateway.

:meth:`VethNamespace.cut` drops every packet both ways while both links stay up
(a partition nobody is told about), :meth:`VethNamespace.heal` restores the path,
and :meth:`VethNamespace.limit_rate` slows what leaves the namespace (``tbf``).
Two ways are offered: ``"loss"`` puts a ``pfifo`` qdisc of length 0 on both ends
(every packet dropped on egress; ``tc qdisc ... netem loss 100%`` does the same
where the kernel has ``sch_netem``, which this one does not), and ``"link down"``
takes the inside end down (``ip link set dev X down``; the outside end loses its
carrier, its route stays and drops what it is given).

Everything is removed by name in ``finally`` blocks: the namespace (which takes
the inside end, and so the pair, with it), the outside end if it is still there,
the blackhole route. Needs ``ip`` and ``tc`` (iproute2) and CAP_NET_ADMIN;
:func:`unavailable` says why they cannot be used, for a skip.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["CUTS", "VethNamespace", "unavailable", "veth_namespace"]

#: How :meth:`VethNamespace.cut` partitions the pair.
CUTS = ("loss", "link down")
#: The private /16 the /30s are taken from (never routed anywhere but the pair).
NET_PREFIX = "10.213"
_BLACKHOLE_METRIC = "4242"
_numbers = itertools.count()


def _run(command: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(command), check=False, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why this machine cannot give a test its own namespace, or None if it can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (Debian/Ubuntu: apt-get install iproute2)"
    probe = f"kvpeer-probe-{os.getpid()}-{next(_numbers)}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return (
            "cannot create a network namespace (needs root: CAP_SYS_ADMIN and "
            f"CAP_NET_ADMIN): {made.stderr.strip()}"
        )
    try:  # a veth pair inside the probe namespace: goes with it
        pair = ("name", "probe0", "type", "veth", "peer", "name", "probe1")
        veth = _run(["ip", "-n", probe, "link", "add", *pair], check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair (kernel without veth?): {veth.stderr.strip()}"
    finally:
        _run(["ip", "netns", "delete", probe], check=False)
    return None


@dataclass(frozen=True, slots=True)
class VethNamespace:
    namespace: str
    outside: str  # the veth end in the root namespace
    inside: str  # the veth end in ``namespace``
    outside_ip: str
    inside_ip: str
    subnet: str  # the /30 of the pair

    def exec_prefix(self) -> list[str]:
        """Put this in front of a command to run it inside the namespace."""
        return ["ip", "netns", "exec", self.namespace]

    def _inside(self, *command: str, check: bool = True) -> None:
        _run([*self.exec_prefix(), *command], check=check)

    def cut(self, how: str = "loss") -> None:
        """Drop every packet between the two ends, both ways, until :meth:`heal`."""
        if how == "loss":  # a queue of length 0: every packet is dropped on egress
            drop = ("root", "pfifo", "limit", "0")
            _run(["tc", "qdisc", "replace", "dev", self.outside, *drop])
            self._inside("tc", "qdisc", "replace", "dev", self.inside, *drop)
        elif how == "link down":
            self._inside("ip", "link", "set", "dev", self.inside, "down")
        else:
            raise ValueError(f"unknown cut {how!r}; one of {CUTS}")

    def limit_rate(self, rate: str) -> None:
        """Shape what leaves the namespace to ``rate`` (tc ``tbf``, e.g. ``"256mbit"``),
        so a transfer lasts long enough to be cut in its middle; :meth:`cut` and
        :meth:`heal` replace it."""
        self._inside(
            "tc", "qdisc", "replace", "dev", self.inside, "root",
            "tbf", "rate", rate, "burst", "64kb", "latency", "1s",
        )  # fmt: skip

    def heal(self) -> None:
        """Undo any :meth:`cut` (each step is harmless if that cut was not made)."""
        _run(["tc", "qdisc", "del", "dev", self.outside, "root"], check=False)
        self._inside("tc", "qdisc", "del", "dev", self.inside, "root", check=False)
        self._inside("ip", "link", "set", "dev", self.inside, "up")


def _free_subnet(number: int) -> tuple[str, str, str]:
    """A /30 of 10.213/16 no interface of the root namespace uses: (subnet, .1, .2)."""
    taken = _run(["ip", "-4", "-o", "addr", "show"]).stdout
    for attempt in range(16384):
        index = (os.getpid() * 8 + number + attempt * 7919) % 16384
        third, fourth = divmod(index * 4, 256)
        base = f"{NET_PREFIX}.{third}."
        if f" {base}{fourth + 1}/" not in taken and f" {base}{fourth + 2}/" not in taken:
            return f"{base}{fourth}/30", f"{base}{fourth + 1}", f"{base}{fourth + 2}"
    raise RuntimeError(f"no free /30 in {NET_PREFIX}.0.0/16")


@contextlib.contextmanager
def veth_namespace() -> Iterator[VethNamespace]:
    """A fresh namespace + veth pair + /30, removed by name when the block ends."""
    number = next(_numbers)
    pid = os.getpid()
    subnet, outside_ip, inside_ip = _free_subnet(number)
    pair = VethNamespace(
        namespace=f"kvpeer-test-{pid}-{number}",
        outside=f"kvp{pid}o{number}"[:15],
        inside=f"kvp{pid}i{number}"[:15],
        outside_ip=outside_ip,
        inside_ip=inside_ip,
        subnet=subnet,
    )
    blackhole = ["blackhole", subnet, "metric", _BLACKHOLE_METRIC]
    try:
        _run(["ip", "route", "add", *blackhole])
        _run(["ip", "netns", "add", pair.namespace])
        _run(["ip", "link", "add", pair.outside, "type", "veth", "peer", "name", pair.inside])
        _run(["ip", "link", "set", "dev", pair.inside, "netns", pair.namespace])
        _run(["ip", "addr", "add", f"{outside_ip}/30", "dev", pair.outside])
        _run(["ip", "link", "set", "dev", pair.outside, "up"])
        pair._inside("ip", "addr", "add", f"{inside_ip}/30", "dev", pair.inside)
        pair._inside("ip", "link", "set", "dev", pair.inside, "up")
        pair._inside("ip", "link", "set", "dev", "lo", "up")
        yield pair
    finally:
        try:
            _run(["ip", "netns", "delete", pair.namespace], check=False)
            _run(["ip", "link", "delete", pair.outside], check=False)
        finally:
            _run(["ip", "route", "del", *blackhole], check=False)
