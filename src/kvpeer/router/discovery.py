"""Engine discovery: which engines exist, from a headless Service's DNS or the Kubernetes API.

A fleet in Kubernetes grows, shrinks and reschedules its engines; a static ``[[engine]]``
list must be edited each time. With a ``[discovery]`` table the router instead asks a
*source* every ``interval_s`` which engines exist now:

- ``dns``: a headless Service's name; its A/AAAA records are the engines' pod IPs, each
  engine named by its address (only the IPv4 ones when there are any: a dual-stack pod is
  one engine);
- ``srv``: an SRV name (``_http._tcp.SERVICE.NAMESPACE.svc.cluster.local``); each record's
  target is an engine, named by the target's first label (a StatefulSet pod's name), its
  port the engine's HTTP port;
- ``kubernetes``: a label selector over the namespace's EndpointSlices (the Service's
  labels are copied onto its slices); each endpoint is an engine named by its pod.

What an engine is then follows from the ``[discovery]`` table's ports and its
``[discovery.engine]`` table (any ``[[engine]]`` key but the addresses), exactly as a
static engine of the same keys.

Invariants (:class:`Membership`):

1. An observation is the whole set a source sees now, or a failure. A failure changes
   nothing: a DNS or API server outage never empties the fleet.
2. An engine joins at the first observation that has it.
3. An engine leaves once no observation has had it for ``leave_after_s``: one that drops
   out and comes back within that (a flapping endpoint, a pod restarting in place) keeps
   its place, and the router keeps what it learned of it.
4. An engine seen at another address (same name) is moved at once: its old address is
   gone.
5. What a source answers is hostile input: at most :data:`MAX_ENGINES` engines, names
   that are words, hosts that are IP literals or DNS names, ports in range; anything else
   in an answer is skipped and counted, never trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import ipaddress
import json
import logging
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from kvpeer.errors import ConfigError

__all__ = [
    "DISCOVERY_KEYS",
    "DiscoveryConfig",
    "DiscoveryFailed",
    "DiscoveryLoop",
    "DnsSource",
    "Found",
    "KubernetesSource",
    "Membership",
    "MembershipStatistics",
    "Resolver",
    "Source",
    "SystemResolver",
    "engine_table",
    "source_for",
]

log = logging.getLogger(__name__)

#: More engines than this in one answer: the answer is refused (a hostile or broken source).
MAX_ENGINES = 4096
#: An API server's answer larger than this is refused.
MAX_ANSWER_BYTES = 16 << 20
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
IN_CLUSTER_API = "https://kubernetes.default.svc"
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._:-]{0,251}[A-Za-z0-9])?")  # IPv6 too
#: The ``[discovery]`` keys (besides the ``engine`` table): key -> (kind, default).
DISCOVERY_KEYS: Mapping[str, tuple[type, object]] = {
    "dns": (str, ""),
    "srv": (str, ""),
    "kubernetes": (str, ""),
    "namespace": (str, ""),
    "api": (str, IN_CLUSTER_API),
    "port_name": (str, "http"),
    "interval_s": (float, 5.0),
    "leave_after_s": (float, 300.0),
    "timeout_s": (float, 5.0),
    "port": (int, 8000),
    "peer_port": (int, 5710),
    "kv_events_port": (int, 5557),
    "kv_events_replay_port": (int, 5558),
}
_SOURCES = ("dns", "srv", "kubernetes")


class DiscoveryFailed(Exception):
    """One observation failed (lookup, API call, answer); the membership stays as it was."""


@dataclass(frozen=True, slots=True)
class Found:
    """One engine a source sees: its name, its host (IP literal or DNS name) and its HTTP
    port when the source says (SRV, EndpointSlice ports), else the template's."""

    name: str
    host: str
    port: int | None = None


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """The ``[discovery]`` table: one source, how often, and what a found engine is."""

    dns: str = ""
    srv: str = ""
    kubernetes: str = ""  # a label selector over EndpointSlices
    namespace: str = ""  # kubernetes: default, the service account's namespace
    api: str = IN_CLUSTER_API
    port_name: str = "http"  # kubernetes: the EndpointSlice port that is the HTTP port
    interval_s: float = 5.0
    # long enough for an engine pod to come back (vLLM loads for minutes): its restart is
    # then one move (a new address), not a leave and a join, each a new generation
    leave_after_s: float = 300.0
    timeout_s: float = 5.0
    port: int = 8000
    peer_port: int = 5710
    kv_events_port: int = 5557  # 0: the engines publish no KV events
    kv_events_replay_port: int = 5558  # 0: no replay endpoint
    #: ``[discovery.engine]``: keys every found engine gets (role, held, tier, ...)
    engine: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, table: object, where: str = "discovery") -> DiscoveryConfig:
        """Parse a ``[discovery]`` table; one ConfigError listing every problem."""
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: expected a table, got {table!r}")
        problems: list[str] = []
        values: dict[str, Any] = {}
        for key, value in table.items():
            if key == "engine":
                if isinstance(value, Mapping):
                    reserved = sorted({"name", "url", "peer", "kv_events",
                                       "kv_events_replay"} & set(value))  # fmt: skip
                    if reserved:
                        problems.append(
                            f"{where}.engine: {reserved} come from what is discovered; set "
                            "the ports in [discovery] (port, peer_port, kv_events_port, ...)"
                        )
                    values["engine"] = dict(value)
                else:
                    problems.append(f"{where}.engine: expected a table, got {value!r}")
                continue
            if key not in DISCOVERY_KEYS:
                problems.append(f"{where}: unknown key {key!r}{suggest(key, DISCOVERY_KEYS)}")
                continue
            kind, _ = DISCOVERY_KEYS[key]
            parsed = _value(value, kind)
            if parsed is None:
                problems.append(f"{where}.{key}: expected {kind.__name__}, got {value!r}")
            else:
                values[key] = parsed
        chosen = [key for key in _SOURCES if values.get(key)]
        if len(chosen) != 1:
            problems.append(
                f"{where}: give exactly one source of {list(_SOURCES)}, got {chosen or 'none'}"
            )
        for key in ("interval_s", "leave_after_s", "timeout_s"):
            if key in values and not 0 < values[key] <= 86400:
                problems.append(f"{where}.{key}: {values[key]!r} must be within (0, 86400] s")
        for key in ("port", "peer_port", "kv_events_port", "kv_events_replay_port"):
            low = 0 if key.startswith("kv_events") else 1
            if key in values and not low <= values[key] <= 65535:
                problems.append(f"{where}.{key}: {values[key]!r} is out of range {low}..65535")
        if values.get("api") and not str(values["api"]).startswith(("http://", "https://")):
            problems.append(f"{where}.api: {values['api']!r} is not an http(s):// URL")
        if problems:
            raise ConfigError("\n".join(problems))
        return cls(**values)

    @property
    def source(self) -> str:
        """Which source: ``dns``, ``srv`` or ``kubernetes``."""
        return next(key for key in _SOURCES if getattr(self, key))


def suggest(key: object, known: Sequence[str] | Mapping[str, object]) -> str:
    """`` (did you mean 'x'?)`` for the closest known key, or nothing."""
    if not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _value(value: object, kind: type) -> Any:
    if isinstance(value, bool):
        return None
    if kind is str:
        return value if isinstance(value, str) else None
    if kind is int:
        return value if isinstance(value, int) else None
    return float(value) if isinstance(value, int | float) else None


def engine_table(config: DiscoveryConfig, found: Found) -> dict[str, Any]:
    """The ``[[engine]]`` table of a found engine: its addresses from the template's ports
    (the source's HTTP port if it gave one), then the ``[discovery.engine]`` keys."""
    host = f"[{found.host}]" if ":" in found.host else found.host
    table: dict[str, Any] = {
        "name": found.name,
        "url": f"http://{host}:{found.port or config.port}",
        "peer": f"{host}:{config.peer_port}",
    }
    if config.kv_events_port:
        table["kv_events"] = f"tcp://{host}:{config.kv_events_port}"
        if config.kv_events_replay_port:
            table["kv_events_replay"] = f"tcp://{host}:{config.kv_events_replay_port}"
    return {**config.engine, **table}


# -- what a source answers ---------------------------------------------------------------


def _host(text: object) -> str | None:
    if not isinstance(text, str):
        return None
    host = text.rstrip(".")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if len(host) <= 253 and all(_LABEL.fullmatch(label) for label in host.split(".")):
        return host.lower()
    return None


def _found(name: object, host: object, port: object = None) -> Found | None:
    """A checked :class:`Found`, or None for anything a source should not have said."""
    clean = _host(host)
    if clean is None or not isinstance(name, str) or not _NAME.fullmatch(name):
        return None
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 1 <= port <= 65535):  # fmt: skip
        return None
    return Found(name, clean, port)


class Source(Protocol):
    """Where engines are found; :meth:`observe` raises :class:`DiscoveryFailed`."""

    async def observe(self) -> list[Found]: ...


class Resolver(Protocol):
    """DNS lookups a :class:`DnsSource` makes; each raises OSError on failure."""

    async def addresses(self, name: str) -> list[str]: ...

    async def services(self, name: str) -> list[tuple[str, int]]: ...


class SystemResolver:
    """A/AAAA through the system's resolver (``getaddrinfo``); SRV through dnspython."""

    async def addresses(self, name: str) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
        return [str(info[4][0]) for info in infos]

    async def services(self, name: str) -> list[tuple[str, int]]:
        try:
            import dns.asyncresolver
            import dns.exception
        except ImportError as exc:
            raise OSError("SRV lookups need dnspython (pip install dnspython)") from exc
        try:
            answer = await dns.asyncresolver.resolve(name, "SRV")
        except dns.exception.DNSException as exc:
            raise OSError(f"SRV {name}: {exc}") from exc
        return [(str(record.target), int(record.port)) for record in answer]


@dataclass(slots=True)
class DnsSource:
    """A headless Service's records: A/AAAA (engines named by address) or SRV."""

    name: str
    resolver: Resolver
    srv: bool = False
    skipped: int = 0  # records that were not a usable engine (invariant 5)

    async def observe(self) -> list[Found]:
        try:
            if self.srv:
                records = await self.resolver.services(self.name)
                found = [_found(target.rstrip(".").split(".")[0], target, port)
                         for target, port in records]  # fmt: skip
            else:
                addresses = _one_family(await self.resolver.addresses(self.name))
                found = [_found(address, address) for address in addresses]
        except OSError as exc:
            raise DiscoveryFailed(f"{'SRV' if self.srv else 'DNS'} {self.name}: {exc}") from exc
        return _bounded(found, self)


def _one_family(addresses: Sequence[str]) -> list[str]:
    """Each address once, and only the IPv4 ones if there are any: a dual-stack pod has an
    A and an AAAA record, and is one engine, not two."""
    unique = list(dict.fromkeys(addresses))
    ipv4 = [a for a in unique if _host(a) is not None and "." in a and ":" not in a]
    return ipv4 or unique


def _bounded(found: Sequence[Found | None], source: DnsSource | KubernetesSource) -> list[Found]:
    if len(found) > MAX_ENGINES:
        raise DiscoveryFailed(f"{len(found)} engines in one answer (at most {MAX_ENGINES})")
    good = [f for f in found if f is not None]
    source.skipped += len(found) - len(good)
    first = {f.name: f for f in reversed(good)}  # one name twice: the first stands
    return [f for f in good if first[f.name] is f]


@dataclass(slots=True)
class KubernetesSource:
    """The namespace's EndpointSlices matching a label selector, listed through the API.

    Authenticates with the pod's service account (its token read at each call: projected
    tokens rotate) and trusts the cluster's CA; ``api`` may be plain ``http://`` (tests,
    ``kubectl proxy``). Needs ``get``/``list`` on ``endpointslices`` (deploy/k8s/router.yaml
    grants it)."""

    api: str
    namespace: str
    selector: str
    session: Callable[[], aiohttp.ClientSession]
    port_name: str = "http"
    timeout_s: float = 5.0
    token_file: Path | None = SERVICE_ACCOUNT / "token"
    ca_file: Path | None = SERVICE_ACCOUNT / "ca.crt"
    skipped: int = 0

    async def observe(self) -> list[Found]:
        url = (f"{self.api.rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/"
               f"{quote(self.namespace, safe='')}/endpointslices")  # fmt: skip
        headers = {"Accept": "application/json"}
        try:
            if self.token_file is not None and self.token_file.exists():
                token = self.token_file.read_text(encoding="utf-8").strip()
                headers["Authorization"] = f"Bearer {token}"
            tls: ssl.SSLContext | bool = True
            if url.startswith("https://") and self.ca_file is not None and self.ca_file.exists():
                tls = ssl.create_default_context(cafile=str(self.ca_file))
            async with asyncio.timeout(self.timeout_s):
                async with self.session().get(url, params={"labelSelector": self.selector},
                                              headers=headers, ssl=tls) as response:  # fmt: skip
                    body = await _read_bounded(response)
                    if response.status != 200:
                        text = body[:200].decode("utf-8", "replace")
                        raise DiscoveryFailed(f"{url}: HTTP {response.status}: {text}")
        except (OSError, aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
            raise DiscoveryFailed(f"{url}: {exc or type(exc).__name__}") from exc
        if len(body) > MAX_ANSWER_BYTES:
            raise DiscoveryFailed(f"{url}: answer larger than {MAX_ANSWER_BYTES} bytes")
        try:
            document = json.loads(body)
        except ValueError as exc:
            raise DiscoveryFailed(f"{url}: not JSON: {exc}") from exc
        return _bounded(self._endpoints(document), self)

    def _endpoints(self, document: object) -> list[Found | None]:
        items = document.get("items") if isinstance(document, dict) else None
        if not isinstance(items, list):
            raise DiscoveryFailed("not an EndpointSliceList (no items)")
        found: list[Found | None] = []
        # A dual-stack Service has an IPv4 and an IPv6 slice naming the same pods: the IPv4
        # one first, so each pod is the same engine at every observation (the first name
        # stands, Membership), never flipping between its addresses.
        dicts = [i for i in items if isinstance(i, dict)]
        found.extend(None for _ in range(len(items) - len(dicts)))
        for item in sorted(dicts, key=lambda i: i.get("addressType") != "IPv4"):
            ports = item.get("ports") or []
            named = [p.get("port") for p in ports
                     if isinstance(p, dict) and p.get("name") == self.port_name]  # fmt: skip
            port = named[0] if named else None
            for endpoint in item.get("endpoints") or []:
                if not isinstance(endpoint, dict):
                    found.append(None)
                    continue
                conditions = endpoint.get("conditions") or {}
                if isinstance(conditions, dict) and conditions.get("terminating") is True:
                    continue  # going away: the router stops naming it now
                addresses = endpoint.get("addresses") or [None]
                ref = endpoint.get("targetRef")
                name = (ref.get("name") if isinstance(ref, dict) else None) or \
                    endpoint.get("hostname") or addresses[0]
                found.append(_found(name, addresses[0], port))
        return found


async def _read_bounded(response: aiohttp.ClientResponse) -> bytes:
    """The body, or a little more than MAX_ANSWER_BYTES of it (then refused)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            break
    return b"".join(chunks)


def source_for(
    config: DiscoveryConfig,
    session: Callable[[], aiohttp.ClientSession],
    resolver: Resolver | None = None,
    service_account: Path = SERVICE_ACCOUNT,
) -> Source:
    """The source a ``[discovery]`` table names."""
    if config.source == "kubernetes":
        namespace = config.namespace
        if not namespace:
            try:
                namespace = (service_account / "namespace").read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(
                    "discovery.namespace: not given, and this is no pod with a service "
                    f"account ({exc.strerror}): name the engines' namespace"
                ) from None
        return KubernetesSource(
            config.api, namespace, config.kubernetes, session, port_name=config.port_name,
            timeout_s=config.timeout_s, token_file=service_account / "token",
            ca_file=service_account / "ca.crt",
        )  # fmt: skip
    resolver = resolver or SystemResolver()
    if config.source == "srv":
        return DnsSource(config.srv, resolver, srv=True)
    return DnsSource(config.dns, resolver)


# -- membership --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MembershipStatistics:
    engines: int
    observations: int
    failures: int
    joined: int
    left: int
    moved: int


class Membership:
    """Which found engines the router runs, from successive observations (invariants 1-4).
    Sans-IO: time is an argument."""

    def __init__(self, leave_after_s: float) -> None:
        self._leave_after_s = leave_after_s
        self._members: dict[str, Found] = {}
        self._seen: dict[str, float] = {}
        self._counts = dict.fromkeys(("observations", "failures", "joined", "left", "moved"), 0)

    @property
    def members(self) -> tuple[Found, ...]:
        return tuple(self._members[name] for name in sorted(self._members))

    def observe(self, found: Sequence[Found] | None, now: float) -> bool:
        """Apply one observation (None: it failed); whether the members changed."""
        self._counts["observations"] += 1
        if found is None:
            self._counts["failures"] += 1
            return False
        changed = False
        seen_now: set[str] = set()
        for engine in found:
            if engine.name in seen_now:
                continue  # one name twice in one answer: the first stands
            seen_now.add(engine.name)
            self._seen[engine.name] = now
            current = self._members.get(engine.name)
            if current != engine:
                self._counts["moved" if current is not None else "joined"] += 1
                self._members[engine.name] = engine
                changed = True
        for name in [n for n in self._members if n not in seen_now]:
            if now - self._seen[name] >= self._leave_after_s:
                del self._members[name], self._seen[name]
                self._counts["left"] += 1
                changed = True
        return changed

    def statistics(self) -> MembershipStatistics:
        return MembershipStatistics(engines=len(self._members), **self._counts)


class DiscoveryLoop:
    """Observes a source every ``interval_s`` and reports each change of members."""

    def __init__(
        self,
        source: Source,
        membership: Membership,
        on_change: Callable[[tuple[Found, ...]], Awaitable[None]],
        *,
        interval_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.source = source
        self.membership = membership
        self._on_change = on_change
        self._interval_s = interval_s
        self._clock = clock
        self._last_error = ""

    async def observe_once(self) -> bool:
        """One observation applied; whether the members changed (and were reported)."""
        try:
            found: list[Found] | None = await self.source.observe()
        except DiscoveryFailed as exc:
            found = None
            if str(exc) != self._last_error:  # each distinct failure once, not every poll
                log.warning("engine discovery failed (the fleet stays as it was): %s", exc)
            self._last_error = str(exc)
        else:
            if self._last_error:
                log.info("engine discovery answers again")
            self._last_error = ""
        before = {f.name for f in self.membership.members}
        changed = self.membership.observe(found, self._clock())
        if changed:
            after = self.membership.members
            names = {f.name for f in after}
            log.info("engines discovered: %d (joined %s, left %s)", len(after),
                     sorted(names - before) or "none", sorted(before - names) or "none")
            await self._on_change(after)
        return changed

    async def run(self, stop: asyncio.Event) -> None:
        """Observe until ``stop``. A change that could not be applied is logged and the
        loop goes on: a dead loop would freeze the fleet without a word."""
        while not stop.is_set():
            try:
                await self.observe_once()
            except Exception:
                log.exception("engine discovery: applying a change failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval_s)
