"""The router's configuration keys declared once: each one's JSON Schema, default, flag and
meaning, from which docs/router.md's key tables and ``router.schema.json`` are generated.

The checks live in :mod:`kvpeer.router.config` (and :mod:`kvpeer.router.configcheck`);
tests/router/test_configkeys.py holds the declarations to them: every key the config
reads is declared here and nothing else is, each top-level default is the
:class:`~kvpeer.router.config.RouterConfig` default, each flag is the parser's, and the
schema accepts exactly the values the checks accept over a table of samples (values of
the right JSON type; the checks also take numbers written as strings, and rules between
keys, such as pd mode's roles, are the checks' alone).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from kvpeer.router import config, configcheck
from kvpeer.router.discovery import DISCOVERY_KEYS

__all__ = ["DISCOVERY", "ENGINE", "TOP_LEVEL", "Key", "markdown", "schema"]

Schema = dict[str, Any]
_SECONDS: Schema = {"type": "number", "exclusiveMinimum": 0}
_BOOL: Schema = {"type": "boolean"}
_ENDPOINT: Schema = {"type": "string", "pattern": "^[a-z]+://.+"}
_HOST_PORT: Schema = {"type": "string", "pattern": "^(\\[[^]]+\\]|[^\\s:]+):[0-9]+$"}


@dataclass(frozen=True, slots=True)
class Key:
    """One configuration key: the JSON Schema of its value and what it is for."""

    name: str
    schema: Schema
    meaning: str
    default: str = ""  # as the docs show it; top-level keys read theirs from RouterConfig


TOP_LEVEL: tuple[Key, ...] = (
    Key("mode", {"enum": ["shared", "pd"]},
        "`shared`: every engine serves whole requests and pulls from peers; `pd`: prefill "
        "on one engine, decode on another", "shared"),
    Key("listen", _HOST_PORT, "HOST:PORT the router serves on", "127.0.0.1:8000"),
    Key("retries", {"type": "integer", "minimum": 0, "maximum": 10},
        "other engines tried, only before the client's first byte"),
    Key("health_interval_s", _SECONDS, "seconds between engine health checks"),
    Key("health_timeout_s", _SECONDS, "how long an engine's `/health` may take"),
    Key("health_restart_failures", {"type": "integer", "minimum": 1, "maximum": 1000},
        "failed checks in a row after which a returning engine without proof of the same "
        "process counts as restarted ([router-health](router-health.md))"),
    Key("connect_timeout_s", _SECONDS, "connecting to an engine"),
    Key("read_timeout_s", _SECONDS, "longest silence from an engine (a whole non-streamed "
        "answer)"),
    Key("prefill_timeout_s", _SECONDS, "a pd prefill leg slower than this: decode-only"),
    Key("tokenize", _BOOL, "ask an engine's `/tokenize` for text prompts (else: load only)"),
    Key("tokenize_timeout_s", _SECONDS, "how long `/tokenize` may take"),
    Key("max_body_bytes", {"type": "integer", "minimum": 1024}, "largest request body"),
    Key("allow_pinning", _BOOL, "honour `X-Kvpeer-Engine` / `X-Kvpeer-Source` request "
        "headers (benchmarks, demos)"),
    Key("engine_step_tokens", {"type": "integer", "minimum": 1, "maximum": 1 << 20},
        "the engines' `--max-num-batched-tokens`: how long a busy source makes a pull wait"),
    Key("policy", {"enum": list(config.POLICIES)},
        "`pull` (KV-aware, pulls when faster), `affinity` (KV-aware, never pulls), `load`"),
    Key("load_scrape_interval_s", {"type": "number", "minimum": 0},
        "seconds between scrapes of each engine's `/metrics` for its load (other routers' "
        "requests); 0: off"),
    Key("prefetch_curve_key", {"type": "string"},
        "this router's CURVE certificate for prefetches to tiers that use CURVE (with the "
        "next)"),
    Key("prefetch_curve_server_key", {"type": "string"}, "the tiers' CURVE server public key"),
    Key("access_log", _BOOL, "one INFO line per request on `kvpeer.router.access`"),
    Key("drain_timeout_s", {"type": "number", "minimum": 0, "maximum": 86400},
        "on shutdown, how long requests in flight may finish"),
)

ENGINE: tuple[Key, ...] = (
    Key("name", {"type": "string", "pattern": "^[^\\s=,\"]+$"},
        "unique; labels its metrics", "(required)"),
    Key("url", {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "its OpenAI server, `http://host:port` (a list: one per data-parallel rank)",
        "(required)"),
    Key("peer", _HOST_PORT, "its kvpeer tier as other engines dial it (ranks: port + rank)",
        "(required)"),
    Key("role", {"enum": ["both", "prefill", "decode"]}, "pd mode: what it runs", "both"),
    Key("kv_events", _ENDPOINT, "its KV event publisher, `tcp://host:port` (not `*`)",
        "none: load only"),
    Key("kv_events_replay", _ENDPOINT, "its replay endpoint: what a router started late "
        "learns", "none"),
    Key("dp_size", {"type": "integer", "minimum": 1, "maximum": 1024},
        "data-parallel ranks behind it: one engine per rank", "1"),
    Key("tier", {"enum": ["kvpeer", "vllm-p2p"]},
        "its peer tier: `kvpeer` turns the next three on, `vllm-p2p` off", "kvpeer"),
    Key("held", _BOOL, "its tier serves held blocks: pulls it answers from them wait for no "
        "engine step (the share it answers so: from its `/metrics`)", "tier kvpeer"),
    Key("sync_pulls", _BOOL, "it runs kvpeer's connector: a pull costs it no extra step",
        "tier kvpeer"),
    Key("ahead", _BOOL, "its tier obeys this router's prefetch: pulls start as the router "
        "forwards the request", "tier kvpeer"),
)

_DISCOVERY_MEANINGS = {
    "dns": "a headless Service's name: its A/AAAA records, engines named by address",
    "srv": "an SRV name: each record's target an engine, named by its first label",
    "kubernetes": "a label selector over the namespace's EndpointSlices, engines named by pod",
    "namespace": "kubernetes: the engines' namespace (default: the pod's own)",
    "api": "kubernetes: the API server",
    "port_name": "kubernetes: the EndpointSlice port that is the engines' HTTP port",
    "interval_s": "seconds between observations of the source",
    "leave_after_s": "an engine missing from every answer this long leaves (long enough "
                     "for a restarting engine to come back: one move, not a leave and a join)",
    "timeout_s": "how long one observation may take",
    "port": "the engines' HTTP port (when the source gives none)",
    "peer_port": "their kvpeer tier's port",
    "kv_events_port": "their KV event port (0: none)",
    "kv_events_replay_port": "their replay port (0: none)",
}


def _discovery_schema(kind: type, name: str) -> Schema:
    if kind is str:
        return {"type": "string", "pattern": "^https?://"} if name == "api" else {"type": "string"}
    if kind is int:
        low = 0 if name.startswith("kv_events") else 1
        return {"type": "integer", "minimum": low, "maximum": 65535}
    return {"type": "number", "exclusiveMinimum": 0, "maximum": 86400}


def _shown(value: object) -> str:
    """A default as the docs show it: TOML's spelling."""
    if isinstance(value, bool | str):
        return json.dumps(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


DISCOVERY: tuple[Key, ...] = tuple(
    Key(name, _discovery_schema(kind, name), _DISCOVERY_MEANINGS[name],
        _shown(default) if default != "" else "-")
    for name, (kind, default) in DISCOVERY_KEYS.items()
)


def defaults() -> dict[str, str]:
    """Each top-level key's default as the docs show it, from RouterConfig itself."""
    found = {"mode": '"shared"', "listen": '"127.0.0.1:8000"'}
    for item in fields(config.RouterConfig):
        if item.name in config.SCALARS and item.default is not MISSING:
            found[item.name] = _shown(item.default)
    return found


def schema() -> Schema:
    """The JSON Schema (draft 2020-12) of a router TOML file, as parsed."""
    engine_properties = {key.name: key.schema for key in ENGINE}
    discovery_properties: Schema = {key.name: key.schema for key in DISCOVERY}
    discovery_properties["engine"] = {
        "type": "object",
        "properties": {k: v for k, v in engine_properties.items()
                       if k not in ("name", "url", "peer", "kv_events", "kv_events_replay")},
        "additionalProperties": False,
    }  # fmt: skip
    properties: Schema = {key.name: {**key.schema, "description": key.meaning}
                          for key in TOP_LEVEL}  # fmt: skip
    properties["engine"] = {
        "type": "array",
        "items": {"type": "object", "properties": engine_properties,
                  "required": ["name", "url", "peer"], "additionalProperties": False},
    }  # fmt: skip
    properties["discovery"] = {
        "type": "object", "properties": discovery_properties, "additionalProperties": False,
        "oneOf": [{"required": [source]} for source in ("dns", "srv", "kubernetes")],
    }  # fmt: skip
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvpeer router configuration (router.toml)",
        "description": "Generated from kvpeer.router.configkeys; `kvpeer check-config "
                       "router.toml` runs the full checks.",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }


def _table(keys: tuple[Key, ...], heading: tuple[str, ...], row: Any) -> str:
    lines = ["| " + " | ".join(heading) + " |", "|" + "---|" * len(heading)]
    lines += ["| " + " | ".join(row(key)) + " |" for key in keys]
    return "\n".join(lines)


def markdown() -> str:
    """docs/router.md's key tables (between its ``router-config`` markers)."""
    shown = defaults()
    flags: Mapping[str, str] = configcheck.flag_names()
    top = _table(TOP_LEVEL, ("key", "default", "flag", "meaning"), lambda k: (
        f"`{k.name}`", shown.get(k.name, k.default), f"`{flags[k.name]}`" if k.name in flags
        else "-", k.meaning))  # fmt: skip
    engine = _table(ENGINE, ("`[[engine]]` key", "default", "meaning"),
                    lambda k: (f"`{k.name}`", k.default, k.meaning))  # fmt: skip
    discovery = _table(DISCOVERY, ("`[discovery]` key", "default", "meaning"),
                       lambda k: (f"`{k.name}`", k.default, k.meaning))  # fmt: skip
    return "\n\n".join((top, engine, discovery)) + "\n"
