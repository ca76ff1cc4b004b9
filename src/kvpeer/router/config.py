"""The router's configuration: one frozen object, built and validated in one place.

It comes from a TOML file (``mode``, ``listen``, timeouts, ``[[engine]]`` tables) and/or
command-line flags (``--engine NAME=URL,peer=H:P,role=...``); flags override the file's
scalars and add engines. Every bad value raises one :class:`~kvpeer.errors.ConfigError`
naming where it came from, the key and the value, because an operator reading a
half-applied config at 3 a.m. needs the line, not a traceback.

An engine table with ``dp_size = N`` expands to N :class:`EngineEntry` s, one per
data-parallel rank, named ``NAME-dpR``, whose kvpeer peer port is ``peer port + R`` (the
tier binds port + DP rank). ``url`` is either one URL for all ranks (vLLM's single API
server; the router then names the rank in the ``X-data-parallel-rank`` header) or a list
of one URL per rank.
"""

from __future__ import annotations

import argparse
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvpeer.errors import ConfigError
from kvpeer.router.discovery import DiscoveryConfig, Found, engine_table
from kvpeer.router.policy import EngineSpec, Mode, Role

__all__ = [
    "POLICIES",
    "EngineEntry",
    "RouterConfig",
    "add_arguments",
    "engine_entries",
    "from_args",
    "from_mapping",
    "load_file",
    "parse_engine_flag",
    "parse_host_port",
]

ENGINE_KEYS = frozenset(
    {"name", "url", "peer", "role", "kv_events", "kv_events_replay", "dp_size", "held",
     "sync_pulls", "ahead", "tier"}
)
#: What runs as an engine's peer tier: kvpeer (held blocks, kvpeer's connector, pulling
#: ahead, unless its keys say otherwise) or vLLM's own p2p tier (none of them).
TIERS = ("kvpeer", "vllm-p2p")
DP_RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One routable engine (one DP rank) and how to address it over HTTP."""

    spec: EngineSpec
    dp_rank: int | None = None  # sent as X-data-parallel-rank: one URL serves several ranks

    @property
    def name(self) -> str:
        return self.spec.name

    def headers(self) -> dict[str, str]:
        """Headers every request to this engine carries (the DP rank, if shared URL)."""
        return {} if self.dp_rank is None else {DP_RANK_HEADER: str(self.dp_rank)}


#: vLLM's default --max-num-batched-tokens for ``vllm serve`` on CPU.
ENGINE_STEP_TOKENS = 2048
#: How the router places requests: ``pull`` (each engine's KV events; serve where the
#: predicted TTFT is lowest, pulling a longer prefix from a peer when that is faster),
#: ``affinity`` (the same without pulls: engines without a peer tier, as a prefix-aware
#: router such as llm-d's runs them) and ``load`` (load only, no KV events).
POLICIES = ("pull", "affinity", "load")
#: How long an engine's ``/health`` may take before the check counts as failed.
DEFAULT_HEALTH_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything ``kvpeer router`` needs; validated on construction."""

    mode: Mode
    engines: tuple[EngineEntry, ...]
    listen_host: str = "127.0.0.1"
    listen_port: int = 8000
    retries: int = 2  # extra attempts on another engine, only before the client's first byte
    health_interval_s: float = 2.0
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    # Consecutive failed checks after which an engine that returns without proof of the
    # same process counts as restarted (health rule 3d); fewer are a flap.
    health_restart_failures: int = 3
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 600.0  # longest silence from an engine (a non-streamed answer
    # arrives whole, so this bounds a whole generation)
    prefill_timeout_s: float = 120.0  # a PD prefill leg taking longer: decode-only
    tokenize: bool = True  # ask an engine's /tokenize for text prompts
    tokenize_timeout_s: float = 5.0
    max_body_bytes: int = 64 << 20
    # Honour a client's ``X-Kvpeer-Engine: NAME`` header (the serving engine; the router
    # still chooses the source). For benchmarks and demos that must place requests;
    # off by default, since it lets a client defeat load balancing.
    allow_pinning: bool = False
    # The engines' step budget (vLLM's --max-num-batched-tokens; 2,048 by default on CPU):
    # a busy source answers a peer between two steps, so its wait is one step at most.
    engine_step_tokens: int = ENGINE_STEP_TOKENS
    policy: str = "pull"  # one of POLICIES
    # Scrape each engine's /metrics for its running and waiting requests this often, so
    # that routers sharing engines see each other's load (kvpeer.router.engineload); 0: off.
    load_scrape_interval_s: float = 1.0
    # Prefetches to tiers that pull ahead go over CURVE when the tiers use it: this
    # router's certificate (public and secret key; its public key in the tiers'
    # client_public_keys_dir) and the tiers' server public key file. Both or neither.
    prefetch_curve_key: str = ""
    prefetch_curve_server_key: str = ""
    # One INFO line per request on logger kvpeer.router.access (engine, plan, TTFT).
    access_log: bool = False
    # On SIGTERM/SIGINT: stop listening, then wait this long for requests in flight (long
    # streams) before cutting them; a rollout's grace period must be longer.
    drain_timeout_s: float = 25.0
    # [discovery]: engines found in DNS or the Kubernetes API, besides ``engines``
    # (kvpeer.router.discovery; served by kvpeer.router.generations).
    discovery: DiscoveryConfig | None = None
    _by_name: dict[str, EngineEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate(self)
        object.__setattr__(self, "_by_name", {e.name: e for e in self.engines})

    @property
    def specs(self) -> tuple[EngineSpec, ...]:
        return tuple(entry.spec for entry in self.engines)

    def entry(self, name: str) -> EngineEntry:
        return self._by_name[name]

    def has(self, name: str) -> bool:
        return name in self._by_name


SCALARS: dict[str, type] = {
    "retries": int,
    "health_interval_s": float,
    "health_timeout_s": float,
    "health_restart_failures": int,
    "connect_timeout_s": float,
    "read_timeout_s": float,
    "prefill_timeout_s": float,
    "allow_pinning": bool,
    "tokenize": bool,
    "tokenize_timeout_s": float,
    "max_body_bytes": int,
    "engine_step_tokens": int,
    "policy": str,
    "load_scrape_interval_s": float,
    "prefetch_curve_key": str,
    "prefetch_curve_server_key": str,
    "access_log": bool,
    "drain_timeout_s": float,
}


def _validate(config: RouterConfig) -> None:
    if not isinstance(config.mode, Mode):
        raise ConfigError(f"mode: {config.mode!r} is not one of pd, shared")
    _check_port("listen", config.listen_port, allow_zero=True)
    if config.retries < 0 or config.retries > 10:
        raise ConfigError(f"retries: {config.retries!r} must be within 0..10")
    for key in ("health_interval_s", "health_timeout_s", "connect_timeout_s",
                "read_timeout_s", "tokenize_timeout_s", "prefill_timeout_s"):
        value = getattr(config, key)
        if not (isinstance(value, float | int) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{key}: {value!r} must be a positive number of seconds")
    drain = config.drain_timeout_s
    if not (isinstance(drain, float | int) and math.isfinite(drain) and 0 <= drain <= 86400):
        raise ConfigError(f"drain_timeout_s: {drain!r} must be within 0..86400 seconds")
    failures = config.health_restart_failures
    if isinstance(failures, bool) or not isinstance(failures, int) or not 1 <= failures <= 1000:
        raise ConfigError(
            f"health_restart_failures: {failures!r} must be an integer within "
            "1..1000 (consecutive failed checks; 1: any return without proof is a restart)"
        )
    if not 1 <= config.engine_step_tokens <= 1 << 20:
        raise ConfigError(
            f"engine_step_tokens: {config.engine_step_tokens!r} must be within 1..{1 << 20} "
            "(the engines' --max-num-batched-tokens)"
        )
    interval = config.load_scrape_interval_s
    if not (isinstance(interval, float | int) and math.isfinite(interval) and interval >= 0):
        raise ConfigError(
            f"load_scrape_interval_s: {interval!r} must be 0 (off) or a positive number of "
            "seconds"
        )
    if config.policy not in POLICIES:
        raise ConfigError(f"policy: {config.policy!r} is not one of {', '.join(POLICIES)}")
    if config.policy == "affinity" and config.mode is Mode.PD:
        raise ConfigError(
            "policy: 'affinity' never pulls, and mode pd moves every prompt from its prefill "
            "engine to its decode engine; use policy 'pull' (or 'load') with mode pd"
        )
    if bool(config.prefetch_curve_key) != bool(config.prefetch_curve_server_key):
        raise ConfigError(
            "prefetch_curve_key and prefetch_curve_server_key: give both (this router's "
            "certificate and the tiers' server public key) or neither, got "
            f"{config.prefetch_curve_key!r} and {config.prefetch_curve_server_key!r}"
        )
    if config.max_body_bytes < 1024:
        raise ConfigError(f"max_body_bytes: {config.max_body_bytes!r} is below 1024")
    if not config.engines:
        if config.discovery is not None:
            return  # the engines are found later (kvpeer.router.generations)
        raise ConfigError("no engines: give [[engine]] tables, a [discovery] table or "
                          "--engine NAME=URL,peer=H:P")
    names: set[str] = set()
    peers: dict[str, str] = {}
    targets: dict[tuple[str, int | None], str] = {}
    for entry in config.engines:
        spec = entry.spec
        if spec.name in names:
            raise ConfigError(f"engine {spec.name!r}: duplicate engine name")
        names.add(spec.name)
        if spec.peer in peers:
            raise ConfigError(
                f"engine {spec.name!r}: peer {spec.peer} is also engine {peers[spec.peer]!r}"
            )
        peers[spec.peer] = spec.name
        target = (spec.url, entry.dp_rank)
        if target in targets:
            raise ConfigError(
                f"engine {spec.name!r}: url {spec.url} is also engine {targets[target]!r}"
            )
        targets[target] = spec.name
        if config.mode is Mode.SHARED and spec.role is not Role.BOTH:
            raise ConfigError(
                f"engine {spec.name!r}: role {spec.role.value!r} means nothing in shared "
                "mode (every engine serves whole requests); drop it or use mode = \"pd\""
            )
    if config.mode is Mode.PD:
        prefill = [e.name for e in config.engines if e.spec.role in (Role.PREFILL, Role.BOTH)]
        decode = [e.name for e in config.engines if e.spec.role in (Role.DECODE, Role.BOTH)]
        if not prefill or not decode or len(config.engines) < 2:
            raise ConfigError(
                "mode pd needs at least one prefill-capable and one decode-capable engine "
                f"on two engines (prefill: {prefill or 'none'}, decode: {decode or 'none'})"
            )


def _check_port(where: str, port: int, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise ConfigError(f"{where}: port {port!r} out of range {low}..65535")


def parse_host_port(where: str, text: object, *, allow_zero: bool = False) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> (host, port); errors name ``where``."""
    if not isinstance(text, str) or ":" not in text:
        raise ConfigError(f"{where}: {text!r} is not host:port")
    host, _, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"{where}: {text!r} has no host")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r}: port {port_text!r} is not a number") from None
    _check_port(f"{where} {text!r}", port, allow_zero=allow_zero)
    return host, port


def _check_url(where: str, url: object) -> str:
    if not isinstance(url, str):
        raise ConfigError(f"{where}: url {url!r} is not a string")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{where}: url {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: url {url!r} is not an http(s)://host[:port] URL")
    if port == 0:
        raise ConfigError(f"{where}: url {url!r}: port out of range 1..65535")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{where}: url {url!r} must be the server's root, without a path")
    return f"{parts.scheme}://{parts.netloc}"


def _number(where: str, value: object, kind: type) -> Any:
    """A number, also from a string ("180"); booleans are not numbers."""
    if kind is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: {value!r} is not a string")
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: {value!r} is not true/false")
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {value!r} is not a number")
    try:
        number = kind(value) if isinstance(value, str | int | float) else None
    except ValueError:
        number = None
    if number is None or (kind is int and isinstance(value, float) and value != number):
        noun = "an integer" if kind is int else "a number"
        raise ConfigError(f"{where}: {value!r} is not {noun}")
    return number


def _engine_entries(where: str, table: Mapping[str, Any]) -> list[EngineEntry]:
    unknown = sorted(set(table) - ENGINE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(ENGINE_KEYS)}")
    name = table.get("name")
    if not isinstance(name, str) or not name or any(c.isspace() or c in "=,\"" for c in name):
        raise ConfigError(f"{where}: name {name!r} must be a non-empty word")
    where = f"engine {name!r}"
    for key in ("url", "peer"):
        if key not in table:
            raise ConfigError(f"{where}: {key} is missing")
    dp_size = _number(f"{where}: dp_size", table.get("dp_size", 1), int)
    if not 1 <= dp_size <= 1024:
        raise ConfigError(f"{where}: dp_size {dp_size!r} must be within 1..1024")
    raw_urls = table["url"]
    if isinstance(raw_urls, list):
        if len(raw_urls) != dp_size:
            raise ConfigError(
                f"{where}: url lists {len(raw_urls)} URLs but dp_size is {dp_size} "
                "(one URL per rank, or one URL for all)"
            )
        urls = [_check_url(where, url) for url in raw_urls]
        shared_url = False
    else:
        urls = [_check_url(where, raw_urls)] * dp_size
        shared_url = dp_size > 1
    host, port = parse_host_port(f"{where}: peer", table["peer"])
    if port + dp_size - 1 > 65535:
        raise ConfigError(
            f"{where}: peer port {port} + dp_size {dp_size} - 1 is beyond 65535"
        )
    role_text = table.get("role", Role.BOTH.value)
    try:
        role = Role(role_text)
    except ValueError:
        raise ConfigError(
            f"{where}: role {role_text!r} is not one of {[r.value for r in Role]}"
        ) from None
    kv_events = table.get("kv_events")
    replay = table.get("kv_events_replay")
    for key, value in (("kv_events", kv_events), ("kv_events_replay", replay)):
        if value is not None and not (isinstance(value, str) and "://" in value):
            raise ConfigError(f"{where}: {key} {value!r} is not an endpoint like tcp://h:p")
        if value is not None and _wildcard(value):
            raise ConfigError(
                f"{where}: {key} {value!r} is a bind address (what the engine's "
                "--kv-events-config gives); the router connects to it: name the engine's "
                "host, e.g. tcp://10.0.0.5:5557"
            )
    tier = table.get("tier", "kvpeer")
    if tier not in TIERS:
        raise ConfigError(f"{where}: tier {tier!r} is not one of {list(TIERS)}")
    # A kvpeer tier as the README starts it holds blocks, runs kvpeer's connector and
    # obeys this router's prefetch; vLLM's own p2p tier does none of that.
    kvpeer = tier == "kvpeer"
    held = _number(f"{where}: held", _flag_text(table.get("held", kvpeer)), bool)
    sync_pulls = _number(f"{where}: sync_pulls", _flag_text(table.get("sync_pulls", kvpeer)), bool)
    ahead = _number(f"{where}: ahead", _flag_text(table.get("ahead", kvpeer)), bool)
    entries = []
    for rank in range(dp_size):
        spec = EngineSpec(
            name=name if dp_size == 1 else f"{name}-dp{rank}",
            url=urls[rank],
            peer_host=host,
            peer_port=port + rank,
            role=role,
            kv_events=kv_events,
            kv_events_replay=replay,
            serves_held=held,
            sync_pulls=sync_pulls,
            pulls_ahead=ahead,
        )
        entries.append(EngineEntry(spec, rank if shared_url else None))
    return entries


def _wildcard(endpoint: str) -> bool:
    """Whether a ZMQ endpoint names no host to connect to (``tcp://*:5557``, 0.0.0.0)."""
    scheme, _, rest = endpoint.partition("://")
    host = rest.rpartition(":")[0].strip("[]")
    return scheme == "tcp" and host in ("*", "0.0.0.0", "::", "")


def _flag_text(value: object) -> object:
    """``true`` / ``false`` as an ``--engine`` flag spells a boolean; anything else as is."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def parse_engine_flag(text: str) -> dict[str, Any]:
    """``NAME=URL,peer=H:P[,role=R][,dp_size=N][,kv_events=E]`` -> an engine table."""
    head, _, rest = text.partition(",")
    name, eq, url = head.partition("=")
    if not eq or not name or not url:
        raise ConfigError(f"--engine {text!r}: expected NAME=URL,peer=HOST:PORT[,role=...]")
    table: dict[str, Any] = {"name": name.strip(), "url": url.strip()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--engine {text!r}: {item!r} is not key=value")
        if key in table:
            raise ConfigError(f"--engine {text!r}: {key} given twice")
        table[key.strip()] = value.strip()
    return table


def load_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc


def from_mapping(
    mapping: Mapping[str, Any],
    source: str = "config",
    extra_engines: Sequence[Mapping[str, Any]] = (),
) -> RouterConfig:
    """Build from a parsed TOML document (plus engine tables from flags)."""
    known = {"mode", "listen", "engine", "discovery", *SCALARS}
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; known: {sorted(known)}")
    mode_text = mapping.get("mode", Mode.SHARED.value)
    try:
        mode = Mode(mode_text)
    except ValueError:
        raise ConfigError(f"{source}: mode {mode_text!r} is not one of pd, shared") from None
    host, port = parse_host_port(
        f"{source}: listen", mapping.get("listen", "127.0.0.1:8000"), allow_zero=True
    )
    tables = mapping.get("engine", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{source}: engine must be [[engine]] tables")
    engines: list[EngineEntry] = []
    for index, table in enumerate([*tables, *extra_engines]):
        engines.extend(_engine_entries(f"{source}: engine #{index + 1}", table))
    scalars = {
        key: _number(f"{source}: {key}", mapping[key], kind)
        for key, kind in SCALARS.items()
        if key in mapping
    }
    discovery = None
    if "discovery" in mapping:
        discovery = DiscoveryConfig.from_mapping(mapping["discovery"], f"{source}: discovery")
        # Every engine found is made from the same template: check it once, now.
        sample = engine_table(discovery, Found("discovered", "192.0.2.1"))
        _engine_entries(f"{source}: discovery.engine", sample)
    return RouterConfig(
        mode=mode, engines=tuple(engines), listen_host=host, listen_port=port,
        discovery=discovery, **scalars,
    )


def engine_entries(
    tables: Sequence[Mapping[str, Any]], source: str = "engine"
) -> tuple[EngineEntry, ...]:
    """The entries of ``[[engine]]``-like tables (discovered engines), checked alike."""
    return tuple(entry for index, table in enumerate(tables)
                 for entry in _engine_entries(f"{source} #{index + 1}", table))  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvpeer router`` flags; each overrides the config file's value."""
    parser.add_argument("--config", help="TOML file: mode, listen, [[engine]] tables, timeouts")
    parser.add_argument("--mode", choices=[m.value for m in Mode], help="pd or shared")
    parser.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:8000)")
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        help="NAME=URL,peer=HOST:PORT[,role=prefill|decode|both][,dp_size=N]"
        "[,kv_events=tcp://H:P][,kv_events_replay=tcp://H:P][,tier=kvpeer|vllm-p2p]"
        "[,held=BOOL][,sync_pulls=BOOL][,ahead=BOOL] (repeatable; adds to the file's "
        "engines; tier kvpeer, the default, turns the next three on, vllm-p2p off; held: its "
        "kvpeer tier serves held blocks without waiting for its engine; sync_pulls: it runs "
        "kvpeer's connector, so a pull costs it no extra step; ahead: its tier obeys this "
        "router's prefetch, so a pull into it starts when the router sends the request)",
    )
    parser.add_argument("--retries", help="attempts on another engine before the first byte")
    parser.add_argument("--health-interval", dest="health_interval_s", help="seconds")
    parser.add_argument("--health-timeout", dest="health_timeout_s", help="seconds")
    parser.add_argument(
        "--health-restart-failures", dest="health_restart_failures",
        help="consecutive failed checks after which a returning engine without proof of the "
        "same process counts as restarted (default 3; 1: any)",
    )
    parser.add_argument("--read-timeout", dest="read_timeout_s", help="seconds")
    parser.add_argument(
        "--prefill-timeout", dest="prefill_timeout_s",
        help="seconds a PD prefill leg may take before the request goes decode-only",
    )
    parser.add_argument(
        "--allow-pinning", action="store_true", default=None,
        help="honour X-Kvpeer-Engine: NAME request headers (benchmarks, demos)",
    )
    parser.add_argument(
        "--no-tokenize", action="store_true", help="never call /tokenize (text prompts: load only)"
    )
    parser.add_argument(
        "--engine-step-tokens", dest="engine_step_tokens",
        help="the engines' --max-num-batched-tokens (default 2048): a busy source's serve wait",
    )
    parser.add_argument(
        "--policy", choices=POLICIES,
        help="pull (default: KV-aware, pulls a peer's prefix when faster), affinity "
             "(KV-aware, never pulls: engines without a peer tier) or load (load only)",
    )
    parser.add_argument(
        "--load-scrape-interval", dest="load_scrape_interval_s",
        help="seconds between scrapes of each engine's /metrics for its running and waiting "
             "requests (default 1; 0: off): routers sharing engines see each other's load",
    )
    parser.add_argument(
        "--prefetch-curve-key", dest="prefetch_curve_key",
        help="this router's CURVE certificate (public and secret key) for prefetches to tiers "
             "that use CURVE; its public key must be in their client_public_keys_dir",
    )
    parser.add_argument(
        "--prefetch-curve-server-key", dest="prefetch_curve_server_key",
        help="the tiers' CURVE server public key file (with --prefetch-curve-key)",
    )
    parser.add_argument(
        "--access-log", action="store_true", default=None,
        help="log one line per request (engine, plan, TTFT) on kvpeer.router.access",
    )
    parser.add_argument(
        "--drain-timeout", dest="drain_timeout_s",
        help="seconds to wait for requests in flight on shutdown (default 25; 0: cut them)",
    )
    parser.add_argument("--ready-file", help="write http://HOST:PORT here once listening")


def from_args(args: argparse.Namespace) -> RouterConfig:
    mapping: dict[str, Any] = load_file(Path(args.config)) if args.config else {}
    source = args.config or "flags"
    for key in ("mode", "listen", "retries", "health_interval_s", "health_timeout_s",
                "health_restart_failures",
                "read_timeout_s", "prefill_timeout_s", "allow_pinning", "engine_step_tokens",
                "policy", "load_scrape_interval_s", "prefetch_curve_key",
                "prefetch_curve_server_key", "access_log", "drain_timeout_s"):
        value = getattr(args, key, None)
        if value is not None:
            mapping[key] = value
    if args.no_tokenize:
        mapping["tokenize"] = False
    flags = [parse_engine_flag(text) for text in args.engine]
    return from_mapping(mapping, source, flags)

