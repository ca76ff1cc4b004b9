"""JSON Schemas of kvpeer's two configurations: a tier entry and a router TOML file.

For editors and config pipelines: ``kvpeer check-config --schema tier|router`` prints
one; docs/schemas/ holds both as generated (scripts/config_docs.py writes them, a test
keeps them current). The checks stay the authority: a schema cannot say "must exceed
load_timeout_s" or "one prefill and one decode engine in pd mode", and the checks also
take numbers written as strings (templates render them so). tests/test_configschema.py
holds each schema to its checks: over a table of samples of the right JSON type per key,
the schema accepts exactly what the checks accept.
"""

from __future__ import annotations

from typing import Any

from kvpeer.config import DATA_TRANSPORTS, MAX_ENGINE_WAIT_S, MAX_SECONDS
from kvpeer.protocol import limits
from kvpeer.router import configkeys

__all__ = ["TIER_KEYS", "router_schema", "schemas", "tier_schema"]

Schema = dict[str, Any]
_SECONDS: Schema = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SECONDS}
_PEERS: Schema = {"anyOf": [{"type": "null"}, {"type": "string"},
                            {"type": "array", "items": {"type": "string"}}]}  # fmt: skip


def _count(low: int, high: int | None = None) -> Schema:
    found: Schema = {"type": "integer", "minimum": low}
    if high is not None:
        found["maximum"] = high
    return found


#: Each tier key's value (the entry of vLLM's ``secondary_tiers`` minus ``type`` and
#: ``module_path``), in docs/configuration.md's terms.
TIER_KEYS: dict[str, Schema] = {
    # an address or a name peers dial back, never a wildcard
    "host": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]+$",
             "not": {"enum": ["0.0.0.0", "::"]}},
    "port": _count(0, 65535),
    "load_timeout_s": _SECONDS,
    "abort_ack_timeout_s": _SECONDS,
    "lookup_pending_timeout_s": _SECONDS,
    "lookup_timeout_s": _SECONDS,
    "store_timeout_s": _SECONDS,
    "unbound_store_timeout_s": _SECONDS,
    "tombstone_retention_s": {**_SECONDS, "maximum": 2 * MAX_SECONDS},
    "handshake_timeout_s": _SECONDS,
    "peer_wait_s": _SECONDS,
    "peer_retry_max_s": _SECONDS,
    "abort_drain_timeout_s": _SECONDS,
    "heartbeat_interval_s": _SECONDS,
    "heartbeat_timeout_s": _SECONDS,
    "max_peers": _count(1),
    "max_queued_messages": _count(1),
    "max_handshakes_per_source": _count(1),
    "max_peer_bytes": _count(1 << 20),
    "held_bytes": _count(0),
    "sync_pull_wait_s": {"type": "number", "minimum": 0, "maximum": MAX_ENGINE_WAIT_S},
    "engine_wait_s": {"type": ["number", "null"], "minimum": 0, "maximum": MAX_SECONDS},
    "trust_peer_addresses": {"type": "boolean"},
    "data_transports": {"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"enum": list(DATA_TRANSPORTS)}, "minItems": 1,
         "uniqueItems": True}]},
    "allowed_peers": _PEERS,
    "nixl_peers": _PEERS,
    "prefetch_from": _PEERS,
    "staging_blocks": _count(0, 1 << 24),
    "prefetch_ttl_s": _SECONDS,
    "hash_seed": {"anyOf": [{"type": "null"},
                            {"type": "string", "minLength": 1,
                             "maxLength": limits.MAX_NAME_CHARS}]},
    "config_fingerprint": {"type": "string", "maxLength": limits.MAX_FINGERPRINT_CHARS},
    "curve": {"anyOf": [{"type": "null"}, {
        "type": "object",
        "properties": {key: {"type": "string", "minLength": 1} for key in
                       ("server_secret_key_file", "server_public_key_file",
                        "client_public_keys_dir")},
        "required": ["server_secret_key_file", "server_public_key_file",
                     "client_public_keys_dir"],
        "additionalProperties": False}]},
}


def tier_schema() -> Schema:
    """One kvpeer tier entry (``kvpeer check-config`` also reads whole kv_transfer_configs)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvpeer tier configuration (an entry of vLLM's secondary_tiers)",
        "description": "Generated from kvpeer.configschema; `kvpeer check-config` runs the "
                       "full checks. vLLM's own keys `type` and `module_path` are allowed.",
        "type": "object",
        "properties": {"type": {"enum": ["kvpeer", "KVPeerTier"]},
                       "module_path": {"type": "string"}, **TIER_KEYS},
        "additionalProperties": False,
    }  # fmt: skip


def router_schema() -> Schema:
    return configkeys.schema()


def schemas() -> dict[str, Schema]:
    """Both, by the name ``--schema`` takes."""
    return {"tier": tier_schema(), "router": router_schema()}
