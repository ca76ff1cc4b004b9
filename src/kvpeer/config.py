"""The tier's configuration: one frozen `TierConfig`, validated in one place.

Input is a plain mapping as a JSON tier config arrives (often rendered by
templates). Invariants:

1. Every `TierConfig` instance is valid and canonical: `from_dict` parses,
   and `__post_init__` re-checks values given directly (or via `replace`).
2. Durations are finite floats in (0, 1e9] seconds (tombstone: 2e9); counts
   are ints in range. Numbers may arrive as strings (``"180"``, ``" 2.5 "``); booleans are never
   numbers; a count given as a float must be integral (``12.0`` -> 12).
3. ``tombstone_retention_s > load_timeout_s`` (default 2 x the effective
   ``load_timeout_s``) and ``heartbeat_timeout_s > heartbeat_interval_s``.
4. Unknown keys are errors. Every problem is reported at once, one line each
   naming its key; bad values are shown with ``repr``.
5. ``allowed_peers`` entries are CIDRs (with "/") or host:port, IPv6 bracketed;
   a bare address is ambiguous ("::1:5710") and rejected. Names never resolve.
6. ``host`` is an IP literal (canonical, unbracketed) or a DNS name, never a
   wildcard: ``peer_id`` (``host:port``, IPv6 bracketed) is what peers dial back.
7. ``TierConfig.from_dict(c.to_dict()) == c``; ``to_dict`` is JSON-able.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Final, TypeAlias

from kvpeer.errors import ConfigError
from kvpeer.protocol import limits
from kvpeer.session.settings import SessionSettings

__all__ = ["DATA_TRANSPORTS", "AllowList", "CurveConfig", "TierConfig", "validate_dict"]

DATA_TRANSPORTS: Final = ("shm", "tcp", "nixl")
MAX_SECONDS: Final = 1e9  # ~31 years: "never" for any sane deployment, and finite when doubled
HELD_SHARE: Final = 4  # automatic held_bytes: a quarter of the primary region ...
HELD_BYTES_MAX: Final = 4 << 30  # ... and at most 4 GiB
MAX_ENGINE_WAIT_S: Final = 1.0  # an engine thread blocked longer stalls every running request
_CURVE_KEYS: Final = ("server_secret_key_file", "server_public_key_file", "client_public_keys_dir")
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")

IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address


class _Invalid(Exception):
    """Problems with one value (args are message lines); never leaves this module."""


def _ip(text: str) -> IPAddress | None:
    """The IP literal `text` (IPv6 optionally bracketed), or None for a name."""
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _is_hostname(text: str) -> bool:
    labels = text.split(".")
    # An all-numeric last label is a mistyped IPv4 address, not a name (RFC 3696).
    return (
        len(text) <= 253
        and all(_LABEL.fullmatch(label) for label in labels)
        and not labels[-1].isdigit()
    )


@dataclass(frozen=True, slots=True)
class AllowList:
    """Which peers may hold a session with us; `everyone` overrides the rest.

    ``networks`` match any port of an address they contain; ``endpoints`` are
    ``(host, port)`` with host a canonical IP string or a lower-case name. A
    name matches only an endpoint with the same name: nothing is resolved.
    """

    everyone: bool = False
    networks: tuple[IPNetwork, ...] = ()
    endpoints: tuple[tuple[str, int], ...] = ()

    @classmethod
    def allow_all(cls) -> AllowList:
        return cls(everyone=True)

    @property
    def nobody(self) -> bool:
        """No peer at all is allowed."""
        return not (self.everyone or self.networks or self.endpoints)

    @classmethod
    def from_entries(cls, entries: Iterable[str]) -> AllowList:
        """Parse CIDRs / host:port strings; raise ConfigError listing every bad one."""
        items = _names(entries, "") if isinstance(entries, str) else list(entries)
        try:
            return _allow_list(items)
        except _Invalid as exc:
            raise ConfigError("\n".join(f"allowed_peers: {line}" for line in exc.args)) from None

    def allows(self, host: str, port: int) -> bool:
        """May `host` (IP literal, IPv6 optionally bracketed, or name) on `port` connect?"""
        if self.everyone:
            return True
        address = _ip(host)
        if address is None:
            return (host.lower(), port) in self.endpoints
        candidates: list[IPAddress] = [address]
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            candidates.append(address.ipv4_mapped)  # dual-stack sockets report IPv4 peers so
        return any(
            (str(candidate), port) in self.endpoints
            or any(candidate in network for network in self.networks)
            for candidate in candidates
        )

    def allows_source(self, source: str) -> bool:
        """May a connection coming from IP address ``source`` (any port) talk to us?

        The claimed identity of a peer is a string it picks; the address its
        connection really comes from is checked too. A ``host:port`` entry admits
        its host's address.
        """
        if self.everyone:
            return True
        address = _ip(source)
        if address is None:
            return False
        candidates: list[IPAddress] = [address]
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            candidates.append(address.ipv4_mapped)
        hosts = {host for host, _ in self.endpoints}
        return any(
            str(candidate) in hosts or any(candidate in network for network in self.networks)
            for candidate in candidates
        )

    def to_entries(self) -> list[str] | None:
        """The entries as config strings; None means everyone."""
        if self.everyone:
            return None
        hosts = [(f"[{h}]" if ":" in h else h, p) for h, p in self.endpoints]
        return [str(n) for n in self.networks] + [f"{h}:{p}" for h, p in hosts]


#: The host's own loopback: whose prefetch a node open to everyone obeys by default.
LOOPBACK: Final = AllowList(
    networks=(ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
)


def _allow_entry(item: object) -> IPNetwork | tuple[str, int]:
    if not isinstance(item, str):
        raise _Invalid(f"expected each entry to be a string, got {item!r}")
    text = item.strip()
    if "/" in text:
        try:
            return ipaddress.ip_network(text, strict=False)
        except ValueError as exc:
            raise _Invalid(f"invalid CIDR {item!r} ({exc})") from None
    if (bare := _ip(text)) is not None:  # "::1:5710" is an address too: never guess
        raise _Invalid(
            f"a bare address is ambiguous: write a CIDR ('{bare}/{bare.max_prefixlen}') or "
            f"host:port (IPv6 bracketed, e.g. '[::1]:5710'), got {item!r}"
        )
    host, sep, port_text = text.rpartition(":")
    port = int(port_text) if port_text.isascii() and port_text.isdigit() else 0
    if host.startswith("[") and host.endswith("]"):
        address = _ip(host)
        if not isinstance(address, ipaddress.IPv6Address):
            raise _Invalid(f"brackets are only for IPv6 addresses, got {item!r}")
        canonical = str(address)
    elif ":" in host:
        raise _Invalid(f"an IPv6 host:port must be bracketed (e.g. '[::1]:5710'), got {item!r}")
    elif (address := _ip(host)) is not None:
        canonical = str(address)
    elif sep and _is_hostname(host):
        canonical = host.lower()
    else:
        raise _Invalid(
            f"expected a CIDR (e.g. '10.0.0.0/8') or host:port (e.g. 'node-a:5710'), got {item!r}"
        )
    if not 1 <= port <= 65535:
        raise _Invalid(f"expected a port from 1 to 65535 after the host, got {item!r}")
    return canonical, port


def _allow_list(items: Sequence[object]) -> AllowList:
    entries: list[IPNetwork | tuple[str, int]] = []
    problems: list[str] = []
    for item in items:
        try:
            entries.append(_allow_entry(item))
        except _Invalid as exc:
            problems.extend(exc.args)
    if not items:
        problems.append("an empty list allows no peer; use null to allow every peer")
    if problems:
        raise _Invalid(*problems)
    return AllowList(
        networks=tuple(e for e in entries if not isinstance(e, tuple)),
        endpoints=tuple(e for e in entries if isinstance(e, tuple)),
    )


@dataclass(frozen=True, slots=True)
class CurveConfig:
    """Paths of the ZMQ CURVE key files; nothing here touches the filesystem."""

    server_secret_key_file: str
    server_public_key_file: str
    client_public_keys_dir: str

    def to_dict(self) -> dict[str, str]:
        return {key: getattr(self, key) for key in _CURVE_KEYS}


# -- value parsers: each returns the canonical value or raises _Invalid -------------------


def _seconds_up_to(value: object, high: float, expected: str = "") -> float:
    """0 to ``high`` seconds; ``expected`` names what else the key takes."""
    seconds = math.nan
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        with suppress(ValueError, OverflowError):
            seconds = float(value)
    if not (math.isfinite(seconds) and 0 <= seconds <= high):
        raise _Invalid(f"expected {expected}0 to {high:g} seconds, got {value!r}")
    return seconds


def _engine_wait(value: object) -> float:
    """Seconds an engine thread may block on a pull: 0 (never) up to MAX_ENGINE_WAIT_S."""
    return _seconds_up_to(value, MAX_ENGINE_WAIT_S)


def _duration(limit: float = MAX_SECONDS) -> Callable[[object], float]:
    def parse(value: object) -> float:
        seconds = math.nan
        if isinstance(value, int | float | str) and not isinstance(value, bool):
            with suppress(ValueError, OverflowError):
                seconds = float(value)
        if not (math.isfinite(seconds) and seconds > 0):
            raise _Invalid(f"expected a positive number of seconds, got {value!r}")
        if seconds > limit:
            raise _Invalid(f"expected at most {limit:g} seconds, got {value!r}")
        return seconds

    return parse


_seconds = _duration()


def _integral(value: object) -> int | None:
    """An int, an integral float (12.0) or a string of either; None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        with suppress(ValueError):
            return int(value)
    try:
        as_float = float(value)
    except ValueError:
        return None
    return int(as_float) if as_float.is_integer() else None


def _count(low: int, high: int | None = None) -> Callable[[object], int]:
    expected = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(value: object) -> int:
        number = _integral(value)
        if number is None or number < low or (high is not None and number > high):
            raise _Invalid(f"expected {expected}, got {value!r}")
        return number

    return parse


def _flag(value: object) -> bool:
    """true/false (JSON booleans, or the strings a template renders); nothing else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _Invalid(f"expected true or false, got {value!r}")


def _host(value: object) -> str:
    if isinstance(value, str) and (text := value.strip()):
        address = _ip(text)
        if address is not None and address.is_unspecified:
            raise _Invalid(f"wildcard address {value!r} cannot be dialled back by peers")
        if address is not None:
            return str(address)
        if _is_hostname(text):
            return text
    raise _Invalid(f"expected an IP address or host name, got {value!r}")


def _optional_name(value: object) -> str | None:
    limit = limits.MAX_NAME_CHARS  # the wire bound of hash_seed
    if value is None or (isinstance(value, str) and value.strip() and len(value) <= limit):
        return value
    raise _Invalid(f"expected null or a non-empty string of at most {limit} chars, got {value!r}")


def _fingerprint(value: object) -> str:
    limit = limits.MAX_FINGERPRINT_CHARS  # the wire bound
    if isinstance(value, str) and len(value) <= limit:
        return value
    raise _Invalid(f"expected a string of at most {limit} characters, got {value!r}")


def _names(value: object, what: str) -> list[object]:
    """A list/tuple as is, or a comma-separated string split (empty parts dropped)."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple):
        return list(value)
    raise _Invalid(f"expected {what} or a comma-separated string, got {value!r}")


def _transports(value: object) -> tuple[str, ...]:
    items = _names(value, "a list of transport names")
    known = ", ".join(map(repr, DATA_TRANSPORTS))
    problems: list[str] = []
    seen: list[str] = []
    for item in items:
        name = item.strip() if isinstance(item, str) else item
        if not isinstance(name, str) or name not in DATA_TRANSPORTS:
            problems.append(f"unknown transport {item!r}{_suggest(name, DATA_TRANSPORTS)}")
        elif name in seen:
            problems.append(f"{name!r} is listed twice")
        else:
            seen.append(name)
    if not items:
        problems.append(f"expected at least one of {known}, got {value!r}")
    elif problems:
        problems.append(f"known transports: {known}")
    if problems:
        raise _Invalid(*problems)
    return tuple(seen)


def _allowed_peers(value: object) -> AllowList:
    if value is None:
        return AllowList.allow_all()
    return _allow_list(_names(value, "null, a list of CIDR / host:port strings"))


def _nixl_peers(value: object) -> AllowList | None:
    if value is None:
        return None
    return _allow_list(_names(value, "null, a list of CIDR / host:port strings"))


def _prefetch_from(value: object) -> AllowList | None:
    if value is None:
        return None  # the default rule: TierConfig.prefetch_trusted
    if isinstance(value, list | tuple) and not value:
        return AllowList()  # nobody: pulling ahead is off
    return _allow_list(_names(value, "null, [] (off), a list of CIDR / host:port strings"))


def _optional_wait(value: object) -> float | None:
    """Seconds from 0 to MAX_SECONDS, or null (no bound)."""
    return None if value is None else _seconds_up_to(value, MAX_SECONDS, "null or ")


def _held_bytes(value: object) -> int | None:
    if value is None:
        return None  # automatic: TierConfig.held_bytes_for
    return _count(0)(value)


def _curve(value: object) -> CurveConfig | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _Invalid(f"expected null or an object with keys {list(_CURVE_KEYS)}, got {value!r}")
    unknown = [key for key in value if key not in _CURVE_KEYS]
    problems = [f"unknown key {key!r}{_suggest(key, _CURVE_KEYS)}" for key in unknown]
    for key in _CURVE_KEYS:
        if key not in value:
            problems.append(f"missing key {key!r}")
        elif not (isinstance(value[key], str) and value[key].strip()):
            problems.append(f"{key}: expected a non-empty path string, got {value[key]!r}")
    if problems:
        raise _Invalid(*problems)
    return CurveConfig(**{key: value[key] for key in _CURVE_KEYS})


def _suggest(key: object, known: Iterable[str]) -> str:
    if not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_PARSERS: Final[Mapping[str, Callable[[object], object]]] = MappingProxyType(
    {
        "host": _host,
        "port": _count(0, 65535),  # 0: any free port (tests, benchmarks)
        "load_timeout_s": _seconds,
        "abort_ack_timeout_s": _seconds,
        "lookup_pending_timeout_s": _seconds,
        "lookup_timeout_s": _seconds,
        "store_timeout_s": _seconds,
        "unbound_store_timeout_s": _seconds,
        "tombstone_retention_s": _duration(2 * MAX_SECONDS),  # default is 2 x load
        "handshake_timeout_s": _seconds,
        "peer_wait_s": _seconds,
        "peer_retry_max_s": _seconds,
        "abort_drain_timeout_s": _seconds,
        "heartbeat_interval_s": _seconds,
        "heartbeat_timeout_s": _seconds,
        "max_peers": _count(1),
        "max_queued_messages": _count(1),
        "max_handshakes_per_source": _count(1),
        "max_peer_bytes": _count(1 << 20),
        "held_bytes": _held_bytes,
        "sync_pull_wait_s": _engine_wait,
        "engine_wait_s": _optional_wait,
        "trust_peer_addresses": _flag,
        "data_transports": _transports,
        "allowed_peers": _allowed_peers,
        "nixl_peers": _nixl_peers,
        "prefetch_from": _prefetch_from,
        "staging_blocks": _count(0, 1 << 24),
        "prefetch_ttl_s": _seconds,
        "hash_seed": _optional_name,
        "config_fingerprint": _fingerprint,
        "curve": _curve,
    }
)
# Must be greater than, checked only when both values are individually valid.
_ORDERED: Final = (
    ("tombstone_retention_s", "load_timeout_s"),
    ("heartbeat_timeout_s", "heartbeat_interval_s"),
)


def _parse(mapping: object) -> tuple[dict[str, Any], list[str]]:
    """Canonical values of the keys given, and every problem found."""
    if not isinstance(mapping, Mapping):
        return {}, [f"tier config: expected a mapping of keys to values, got {mapping!r}"]
    problems = []
    for key in mapping:
        if key in ("type", "module_path"):
            problems.append(f"unknown key {key!r} (strip 'type' and 'module_path' first)")
        elif key not in _PARSERS:
            problems.append(f"unknown key {key!r}{_suggest(key, _PARSERS)}")
    values: dict[str, Any] = {}
    for key, parse in _PARSERS.items():
        if key in mapping:
            try:
                values[key] = parse(mapping[key])
            except _Invalid as exc:
                problems.extend(f"{key}: {line}" for line in exc.args)
    bad = {key for key in mapping if key in _PARSERS and key not in values}
    effective: dict[str, Any] = {f.name: f.default for f in fields(TierConfig)} | values
    if "tombstone_retention_s" not in mapping:
        effective["tombstone_retention_s"] = 2 * effective["load_timeout_s"]
        values["tombstone_retention_s"] = effective["tombstone_retention_s"]
    for larger, smaller in _ORDERED:
        if not {larger, smaller} & bad and not effective[larger] > effective[smaller]:
            problems.append(
                f"{larger}: must exceed {smaller}, got {larger}={effective[larger]!r} "
                f"and {smaller}={effective[smaller]!r}"
            )
    return values, problems


def validate_dict(mapping: object) -> list[str]:
    """Every problem with a tier config mapping, one line each; [] when valid."""
    return _parse(mapping)[1]


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Effective configuration of one kvpeer tier (docs/design.md section 6).

    Build it with `from_dict`; ``TierConfig()`` equals ``from_dict({})``. When
    constructing directly, ``tombstone_retention_s`` is not re-derived.
    """

    host: str = "127.0.0.1"
    port: int = 5710
    load_timeout_s: float = 30.0
    abort_ack_timeout_s: float = 12.0  # over vLLM p2p producers' 10 s cancel drain
    lookup_pending_timeout_s: float = 5.0
    lookup_timeout_s: float = 30.0
    store_timeout_s: float = 30.0
    unbound_store_timeout_s: float = 60.0
    tombstone_retention_s: float = 60.0
    handshake_timeout_s: float = 30.0
    peer_wait_s: float = 1.5
    peer_retry_max_s: float = 30.0
    abort_drain_timeout_s: float = 3.0  # under vLLM 0.34 consumers' 5 s abort-ack wait
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    max_peers: int = 128
    max_queued_messages: int = 4096
    max_handshakes_per_source: int = 8
    max_peer_bytes: int = 64 << 20
    #: bytes of blocks the tier keeps a copy of, to serve peers without a serve
    #: window (kvpeer.node.held); None: automatic (held_bytes_for); 0: off, every
    #: peer request waits for one
    held_bytes: int | None = None
    #: how long the engine's scheduler may wait, inside the lookup that found a
    #: peer's blocks, for the pull to land (kvpeer.integrations.vllm.manager); a pull
    #: that takes longer completes a step later, as vLLM's own promotions do. 0: never
    sync_pull_wait_s: float = 0.05
    #: how long a peer's lookup that held blocks cannot answer waits for this engine's
    #: steps (kvpeer.node.enginewait): past a step that has run this long, or this long
    #: after it reached an idle engine, it is answered without the engine; None: no
    #: bound but lookup_pending_timeout_s
    engine_wait_s: float | None = 0.25
    trust_peer_addresses: bool = False
    data_transports: tuple[str, ...] = DATA_TRANSPORTS
    allowed_peers: AllowList = field(default_factory=AllowList.allow_all)
    nixl_peers: AllowList | None = None
    #: routers whose ``prefetch`` this node obeys (kvpeer.node.ahead: pulling ahead);
    #: None, the default: the rule of prefetch_trusted; an empty list: nobody
    prefetch_from: AllowList | None = None
    #: rows of the primary region withheld from the engine's own cache, once, at start,
    #: to stage prefetched blocks in (none when nobody may send prefetches)
    staging_blocks: int = 256
    #: how long a staged block waits for the request it was fetched for
    prefetch_ttl_s: float = 10.0
    hash_seed: str | None = None
    config_fingerprint: str = ""
    curve: CurveConfig | None = None

    def __post_init__(self) -> None:
        values, problems = _parse(self.to_dict())
        if problems:
            raise ConfigError("\n".join(problems))
        for name, value in values.items():
            object.__setattr__(self, name, value)  # canonical form (frozen)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, object]) -> TierConfig:
        """Parse a tier config; raise one ConfigError listing every problem."""
        values, problems = _parse(mapping)
        if problems:
            raise ConfigError("\n".join(problems))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The effective config as JSON-able values; `from_dict` round-trips it."""
        result: dict[str, Any] = {name: getattr(self, name) for name in _PARSERS}
        result["data_transports"] = list(self.data_transports)
        result["allowed_peers"] = self.allowed_peers.to_entries()
        result["nixl_peers"] = None if self.nixl_peers is None else self.nixl_peers.to_entries()
        result["prefetch_from"] = (
            None if self.prefetch_from is None else self.prefetch_from.to_entries() or []
        )
        result["curve"] = None if self.curve is None else self.curve.to_dict()
        return result

    def nixl_trusted(self) -> AllowList:
        """Peers whose NIXL agent metadata we load (our nixl writes go where it says,
        and NIXL parses it in native code). ``nixl_peers`` if given; otherwise
        ``allowed_peers`` when it is an explicit list or CURVE authenticates peers;
        otherwise nobody."""
        if self.nixl_peers is not None:
            return self.nixl_peers
        if not self.allowed_peers.everyone or self.curve is not None:
            return self.allowed_peers
        return AllowList()

    def prefetch_trusted(self) -> AllowList:
        """Whose ``prefetch`` this node obeys (docs/security.md, pulling ahead).

        ``prefetch_from`` if given. Otherwise the peers the node already trusts: an
        explicit ``allowed_peers`` list (routers sit in the fleet's network), or,
        with CURVE, every connection (only holders of an admitted key get one).
        A node open to everyone obeys only its own host's loopback: a prefetch names
        the peer whose blocks the engine will use, a choice only the routers own, so
        an open node never takes it from the network."""
        if self.prefetch_from is not None:
            return self.prefetch_from
        if not self.allowed_peers.everyone or self.curve is not None:
            return self.allowed_peers
        return LOOPBACK

    def held_bytes_for(self, region_bytes: int, block_len: int) -> int:
        """Bytes of held blocks for a primary region of ``region_bytes``: ``held_bytes``
        if given, else a quarter of the region, at most :data:`HELD_BYTES_MAX`; whole
        blocks only."""
        if self.held_bytes is not None:
            wanted = self.held_bytes
        else:
            wanted = min(region_bytes // HELD_SHARE, HELD_BYTES_MAX)
        return wanted - wanted % block_len if block_len > 0 else 0

    @property
    def peer_id(self) -> str:
        """``host:port`` as peers dial it back; IPv6 hosts are bracketed."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def session_settings(self) -> SessionSettings:
        return SessionSettings(
            load_timeout_s=self.load_timeout_s,
            abort_ack_timeout_s=self.abort_ack_timeout_s,
            lookup_timeout_s=self.lookup_timeout_s,
            lookup_pending_timeout_s=self.lookup_pending_timeout_s,
            store_timeout_s=self.store_timeout_s,
            abort_drain_timeout_s=self.abort_drain_timeout_s,
            transfer_timeout_s=self.load_timeout_s + self.abort_ack_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
            peer_wait_s=self.peer_wait_s,
            max_queued_messages=self.max_queued_messages,
            max_peer_bytes=self.max_peer_bytes,
        )
