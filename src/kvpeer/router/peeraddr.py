"""Engines' tier addresses as other engines must dial them: peer host names resolved.

A kvpeer tier advertises an IP address as its identity, its connections come from that
address, and ``allowed_peers`` matches addresses: names are never resolved there (config
invariant 5). An operator names engines by names that outlive them (a StatefulSet pod's
DNS name survives a restart; its IP does not). So the router resolves each engine's
``peer`` host name and names the address in ``remote_host``, never the name.

Invariants:

1. An IP literal is used as given and never looked up.
2. A name resolves to the first address the resolver returns. While a lookup fails the
   last good address is kept; a name never resolved has no address, and a request that
   would pull from it computes locally instead (:meth:`PeerAddresses.dialable` is None).
3. Every name is looked up concurrently, each lookup bounded by the timeout, so one
   slow name cannot hold up the others.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from kvpeer.router.policy import EngineSpec

__all__ = ["PeerAddressStatistics", "PeerAddresses", "Resolver", "system_resolver"]

log = logging.getLogger(__name__)

#: ``(host, port) -> addresses`` (IP literals), first preferred; raises OSError on failure.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """The system's resolver (``getaddrinfo``, TCP) run off the event loop."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class PeerAddressStatistics:
    names: int  # engines whose peer host is a name
    resolved: int  # of those, how many have an address
    lookups: int
    lookup_failures: int
    changes: int  # a name answered a different address than before (a pod restarted)


class PeerAddresses:
    """The dialable address of every engine's tier, refreshed by :meth:`refresh`."""

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        *,
        timeout_s: float,
        resolver: Resolver = system_resolver,
    ) -> None:
        self._resolver = resolver
        self._timeout_s = timeout_s
        self._names = sorted({s.peer_host for s in specs if not _is_ip(s.peer_host)})
        self._port = {s.peer_host: s.peer_port for s in specs}
        self._address: dict[str, str] = {}
        self._lookups = 0
        self._failures = 0
        self._changes = 0

    def dialable(self, spec: EngineSpec | None) -> EngineSpec | None:
        """``spec`` with its peer host as an IP address; None if its name has none yet."""
        if spec is None or _is_ip(spec.peer_host):
            return spec
        address = self._address.get(spec.peer_host)
        return None if address is None else replace(spec, peer_host=address)

    async def refresh(self) -> None:
        """Look every name up once (invariant 3)."""
        await asyncio.gather(*(self._lookup(name) for name in self._names))

    async def run(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` until cancelled (the first round is the caller's)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()

    async def _lookup(self, name: str) -> None:
        self._lookups += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                answers = await self._resolver(name, self._port[name])
            address = next(
                (str(ipaddress.ip_address(a)) for a in answers if _is_ip(a)), None
            )  # fmt: skip
        except (OSError, TimeoutError) as exc:
            address, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = f"no address in {list(answers)!r}"
        if address is None:
            self._failures += 1
            kept = self._address.get(name)
            log.warning("peer %s did not resolve (%s); %s", name, why,
                        f"keeping {kept}" if kept else "requests will not pull from it")
            return
        old = self._address.get(name)
        if old != address:
            if old is not None:
                self._changes += 1
            log.info("peer %s is at %s%s", name, address, f" (was {old})" if old else "")
            self._address[name] = address

    def statistics(self) -> PeerAddressStatistics:
        return PeerAddressStatistics(
            names=len(self._names),
            resolved=sum(1 for name in self._names if name in self._address),
            lookups=self._lookups,
            lookup_failures=self._failures,
            changes=self._changes,
        )
