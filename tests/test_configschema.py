"""Each configuration declared once: the JSON Schemas and the docs' key tables agree with
the checks they describe (kvpeer.configschema, kvpeer.router.configkeys).

Agreement is tested over samples of the right JSON type per key (the checks also take
numbers written as strings, and apply rules between keys and inside strings, CIDRs and
URLs, that a schema does not state): for each, the schema accepts it exactly when the
check does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped,unused-ignore]
import pytest
from scripts import config_docs

from kvpeer import configschema
from kvpeer.config import TierConfig, validate_dict
from kvpeer.router import config, configcheck, configkeys
from kvpeer.router.discovery import DISCOVERY_KEYS, DiscoveryConfig

ROOT = Path(__file__).resolve().parent.parent


def valid(schema: dict[str, Any], document: object) -> bool:
    return not list(jsonschema.Draft202012Validator(schema).iter_errors(document))


def test_the_schemas_are_schemas() -> None:
    for schema in configschema.schemas().values():
        jsonschema.Draft202012Validator.check_schema(schema)


# -- the tier -----------------------------------------------------------------------------

SECONDS = [0.5, 30, 1e9, 0, -1, 1.1e9, True, "x", None]
TIER_SAMPLES: dict[str, list[object]] = {
    "host": ["10.0.0.5", "node-a", "::1", "0.0.0.0", "::", "", "bad host", 5, None],
    "port": [0, 5710, 65535, 65536, -1, 1.5, True],
    "tombstone_retention_s": [61, 2e9, 2.1e9, 0, -5, True],  # above load_timeout_s (30)
    "heartbeat_interval_s": [0.5, 2, 0, -1, True],  # below heartbeat_timeout_s (10)
    "heartbeat_timeout_s": [3, 1e9, 0, -1, True],  # above heartbeat_interval_s (2)
    "max_peers": [1, 128, 0, -1, 1.5, True, "x"],
    "max_queued_messages": [1, 4096, 0, 2.5, False],
    "max_handshakes_per_source": [1, 8, 0, True],
    "max_peer_bytes": [1 << 20, 64 << 20, (1 << 20) - 1, 0, True],
    "held_bytes": [0, 1 << 30, -1, 1.5, True],
    "sync_pull_wait_s": [0, 0.05, 1, 1.5, -0.1, True],
    "engine_wait_s": [None, 0, 0.25, 1e9, 1.1e9, -0.1, True, "x"],
    "trust_peer_addresses": [True, False, 1, None],
    "data_transports": [["tcp"], ["shm", "tcp", "nixl"], "tcp", [], ["tcp", "tcp"],
                        ["bogus"], 5, None],
    "allowed_peers": [None, ["10.0.0.0/8"], ["node-a:5710"], "10.0.0.0/8", 5, True],
    "nixl_peers": [None, ["10.0.0.0/8"], 5],
    "prefetch_from": [None, ["10.0.0.7/32"], 5, True],
    "staging_blocks": [0, 256, 1 << 24, (1 << 24) + 1, -1, True],
    "hash_seed": [None, "seed", "x" * 512, "x" * 513, "", 5],
    "config_fingerprint": ["", "f", "x" * 128, "x" * 129, 5, None],
    "curve": [None, {"server_secret_key_file": "s", "server_public_key_file": "p",
                     "client_public_keys_dir": "d"},
              {"server_secret_key_file": "s", "server_public_key_file": "p"},
              {"server_secret_key_file": "s", "server_public_key_file": "p",
               "client_public_keys_dir": "d", "extra": "x"}, 5],
}


def tier_samples(key: str) -> list[object]:
    return TIER_SAMPLES.get(key, SECONDS)


def test_every_tier_key_has_a_schema_and_samples() -> None:
    keys = set(TierConfig().to_dict())
    assert set(configschema.TIER_KEYS) == keys
    assert set(TIER_SAMPLES) - keys == set()


@pytest.mark.parametrize("key", sorted(configschema.TIER_KEYS))
def test_the_tier_schema_accepts_what_the_check_accepts(key: str) -> None:
    schema = configschema.tier_schema()
    for sample in tier_samples(key):
        checked = validate_dict({key: sample}) == []
        assert valid(schema, {key: sample}) == checked, (key, sample, validate_dict({key: sample}))
    assert not valid(schema, {"load_timout_s": 3})  # unknown keys, as the check


# -- the router ---------------------------------------------------------------------------

ENGINE = {"name": "a", "url": "http://10.0.0.1:8000", "peer": "10.0.0.1:5710"}
OTHER = {"name": "b", "url": "http://10.0.0.2:8000", "peer": "10.0.0.2:5710"}
GOOD: dict[str, Any] = {"engine": [ENGINE, OTHER]}
INTEGERS = [0, 1, 2, 10, 11, 1000, 1001, 1 << 20, (1 << 20) + 1, -1, 1.5, True, "x"]
NUMBERS = [0, 0.5, 25, 86400, 86401, -1, True, "x", None]
ROUTER_SAMPLES: dict[str, list[object]] = {
    "mode": ["shared", "pd", "both", 5],
    "listen": ["0.0.0.0:8000", "[::1]:0", "127.0.0.1:1", "0.0.0.0", 8000],
    "policy": ["pull", "affinity", "load", "random", 5],
    "max_body_bytes": [1024, 64 << 20, 1023, -1, True],
    "prefetch_curve_key": ["", 5],
    "prefetch_curve_server_key": ["", 5],
}
ENGINE_SAMPLES: dict[str, list[object]] = {
    "url": ["http://10.0.0.1:8000", "https://h", 5],
    "peer": ["10.0.0.1:5710", "[::1]:5710", "10.0.0.1", 5],
    "role": ["both", "chief", 5],
    "kv_events": ["tcp://10.0.0.1:5557", "5557", 5],
    "kv_events_replay": ["tcp://10.0.0.1:5558", "h:5558", 5],
    "dp_size": [1, 4, 1024, 0, 1025, 1.5, True],
    "tier": ["kvpeer", "vllm-p2p", "p2p", 5],
    "held": [True, False, 1],
    "sync_pulls": [True, False, 1],
    "ahead": [True, False, 1],
}


def router_samples(key: str) -> list[object]:
    if key in ROUTER_SAMPLES:
        return ROUTER_SAMPLES[key]
    kind = config.SCALARS[key]
    return [True, False, 1, "x"] if kind is bool else INTEGERS if kind is int else NUMBERS


def router_valid(document: dict[str, Any]) -> bool:
    return configcheck.problems(document, "router.toml") == []


def test_every_router_key_is_declared_once() -> None:
    names = [k.name for k in configkeys.TOP_LEVEL]
    assert len(names) == len(set(names))
    assert set(names) == {"mode", "listen", *config.SCALARS}
    assert {k.name for k in configkeys.ENGINE} == set(config.ENGINE_KEYS)
    assert [k.name for k in configkeys.DISCOVERY] == list(DISCOVERY_KEYS)
    assert set(configkeys.schema()["properties"]) == set(configcheck.TOP_LEVEL_KEYS)


def test_the_documented_defaults_are_the_configs() -> None:
    shown = configkeys.defaults()
    built = config.from_mapping(GOOD)
    for key in config.SCALARS:
        value = getattr(built, key)
        expected = json.dumps(value) if isinstance(value, bool | str) else f"{value:g}"
        assert shown[key] in (expected, str(value)), key
    discovery = DiscoveryConfig.from_mapping({"dns": "x"})
    for declared in configkeys.DISCOVERY:
        if declared.default != "-":
            assert json.loads(declared.default) == getattr(discovery, declared.name)


@pytest.mark.parametrize("key", [k.name for k in configkeys.TOP_LEVEL])
def test_the_router_schema_accepts_what_the_checks_accept(key: str) -> None:
    schema = configkeys.schema()
    for sample in router_samples(key):
        document = GOOD | {key: sample}
        assert valid(schema, document) == router_valid(document), (key, sample)


@pytest.mark.parametrize("key", sorted(ENGINE_SAMPLES))
def test_the_router_schema_accepts_the_engine_values_the_checks_accept(key: str) -> None:
    schema = configkeys.schema()
    for sample in ENGINE_SAMPLES[key]:
        document = {"engine": [ENGINE | {key: sample}, OTHER]}
        assert valid(schema, document) == router_valid(document), (key, sample)
    unknown = {"engine": [ENGINE | {"rolle": "both"}, OTHER]}
    assert not valid(schema, unknown)
    assert not router_valid(unknown)


@pytest.mark.parametrize("key", list(DISCOVERY_KEYS))
def test_the_router_schema_accepts_the_discovery_values_the_checks_accept(key: str) -> None:
    schema = configkeys.schema()
    kind = DISCOVERY_KEYS[key][0]
    base: dict[str, Any] = {} if key in ("dns", "srv", "kubernetes") else {"dns": "engines"}
    samples: list[object]
    if kind is str:
        samples = ["x", 5] if key != "api" else ["http://h:1", "https://h", "ftp://h", 5]
    elif kind is int:
        samples = [0, 1, 8000, 65535, 65536, -1, 1.5, True]
    else:
        samples = [0, 0.5, 5, 86400, 86401, -1, True, "x"]
    for sample in samples:
        document = {"discovery": base | {key: sample}}
        assert valid(schema, document) == router_valid(document), (key, sample)


# -- generated files ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tier", "router"])
def test_the_schema_files_are_generated_from_the_declarations(name: str) -> None:
    path = ROOT / "docs" / "schemas" / f"{name}.schema.json"
    assert path.read_text(encoding="utf-8") == config_docs.schema_text(name), (
        "run python scripts/config_docs.py"
    )


def test_the_router_docs_tables_are_generated_from_the_declarations() -> None:
    text = (ROOT / "docs" / "router.md").read_text(encoding="utf-8")
    assert config_docs.router_doc(text) == text, "run python scripts/config_docs.py"


def tier_table_rows() -> dict[str, str]:
    """docs/configuration.md's tier table: key -> its default cell."""
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows: dict[str, str] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            keys = re.findall(r"`([a-z_]+)`", cells[0])
            defaults = [part.strip() for part in cells[1].split(",")]
            for index, key in enumerate(keys):
                rows[key] = defaults[index] if len(defaults) == len(keys) else cells[1]
    return rows


def test_the_tier_docs_table_names_every_key_and_its_numeric_defaults() -> None:
    rows = tier_table_rows()
    assert set(rows) == set(configschema.TIER_KEYS)
    defaults = TierConfig().to_dict()
    checked = 0
    for key, cell in rows.items():
        number = re.fullmatch(r"([0-9.]+)(?: \(.*\))?", cell)
        if number and key != "tombstone_retention_s":  # documented as 2 x load_timeout_s
            assert float(number.group(1)) == defaults[key], (key, cell)
            checked += 1
    assert checked >= 15


def test_check_config_prints_each_schema() -> None:
    import subprocess
    import sys

    for name, schema in configschema.schemas().items():
        result = subprocess.run(
            [sys.executable, "-m", "kvpeer", "check-config", "--schema", name],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert json.loads(result.stdout) == schema
