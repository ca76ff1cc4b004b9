"""Behaviour of kvpeer.config: parsing, validation, allow-lists, round trips."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvpeer.config
from kvpeer.config import DATA_TRANSPORTS, AllowList, CurveConfig, TierConfig, validate_dict
from kvpeer.errors import ConfigError, KVPeerError
from kvpeer.session.settings import SessionSettings

DURATION_KEYS = (
    "load_timeout_s",
    "abort_ack_timeout_s",
    "lookup_pending_timeout_s",
    "lookup_timeout_s",
    "store_timeout_s",
    "unbound_store_timeout_s",
    "tombstone_retention_s",
    "handshake_timeout_s",
    "abort_drain_timeout_s",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
)
COUNT_KEYS = ("max_peers", "max_queued_messages")
CURVE = {
    "server_secret_key_file": "/etc/kvpeer/server.key_secret",
    "server_public_key_file": "/etc/kvpeer/server.key",
    "client_public_keys_dir": "/etc/kvpeer/clients",
}


def problems_of(mapping: Any) -> list[str]:
    """The problem lines of `mapping`, checking from_dict raises exactly those."""
    lines = validate_dict(mapping)
    assert lines, f"expected {mapping!r} to be invalid"
    with pytest.raises(ConfigError) as info:
        TierConfig.from_dict(mapping)
    assert str(info.value).split("\n") == lines
    return lines


def only_problem(mapping: Any) -> str:
    lines = problems_of(mapping)
    assert len(lines) == 1, lines
    return lines[0]


def with_room(key: str, value: object) -> dict[str, object]:
    """`{key: value}` plus companions so that ordering rules cannot fail."""
    mapping: dict[str, object] = {
        "load_timeout_s": 0.0001,
        "heartbeat_interval_s": 0.0001,
        "heartbeat_timeout_s": 1e6,
    }
    mapping[key] = value
    return mapping


# -- public surface and defaults ----------------------------------------------------------


def test_public_surface_is_pinned() -> None:
    assert sorted(kvpeer.config.__all__) == [
        "AllowList",
        "CurveConfig",
        "DATA_TRANSPORTS",
        "TierConfig",
        "validate_dict",
    ]


def test_config_error_is_a_kvpeer_error_and_a_value_error() -> None:
    with pytest.raises(ConfigError) as info:
        TierConfig.from_dict({"port": 70000})
    assert isinstance(info.value, KVPeerError)
    assert isinstance(info.value, ValueError)


def test_defaults_match_the_design() -> None:
    config = TierConfig.from_dict({})
    assert config == TierConfig()
    assert config.host == "127.0.0.1"
    assert config.port == 5710
    assert config.peer_id == "127.0.0.1:5710"
    assert config.load_timeout_s == 30.0
    assert config.abort_ack_timeout_s == 12.0  # over a vLLM producer's 10 s cancel drain
    assert config.lookup_pending_timeout_s == 5.0
    assert config.lookup_timeout_s == 30.0
    assert config.store_timeout_s == 30.0
    assert config.unbound_store_timeout_s == 60.0
    assert config.tombstone_retention_s == 60.0
    assert config.handshake_timeout_s == 30.0
    # under abort_ack_timeout_s and vLLM 0.34's 5 s: we ack first (docs/interop.md)
    assert config.abort_drain_timeout_s == 3.0
    assert config.heartbeat_interval_s == 2.0
    assert config.heartbeat_timeout_s == 10.0
    assert config.max_peers == 128
    assert config.max_queued_messages == 4096
    assert config.data_transports == ("shm", "tcp", "nixl") == DATA_TRANSPORTS
    assert config.allowed_peers == AllowList.allow_all()
    assert config.hash_seed is None
    assert config.config_fingerprint == ""
    assert config.curve is None
    assert validate_dict({}) == []


def test_config_is_frozen_and_hashable() -> None:
    config = TierConfig.from_dict({"allowed_peers": ["10.0.0.0/8"], "curve": CURVE})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]
    assert hash(config) == hash(TierConfig.from_dict(config.to_dict()))


# -- durations ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", DURATION_KEYS)
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (1, 1.0),
        (2.5, 2.5),
        (0.001, 0.001),
        ("180", 180.0),
        (" 2.5 ", 2.5),
        ("1e3", 1000.0),
        ("7\n", 7.0),
    ],
)
def test_duration_accepts_numbers_and_numeric_strings(
    key: str, raw: object, expected: float
) -> None:
    value = getattr(TierConfig.from_dict(with_room(key, raw)), key)
    assert value == expected
    assert type(value) is float


@pytest.mark.parametrize("key", DURATION_KEYS)
@pytest.mark.parametrize(
    "raw",
    [
        "abc",
        "",
        "  ",
        True,
        False,
        "true",
        None,
        0,
        0.0,
        "0",
        -1,
        "-2.5",
        math.nan,
        math.inf,
        -math.inf,
        "nan",
        "inf",
        "-Infinity",
        "1e400",
        10**400,
        [30],
        {"s": 30},
    ],
)
def test_duration_rejects_non_positive_non_finite_and_non_numbers(key: str, raw: object) -> None:
    line = only_problem(with_room(key, raw))
    assert line == f"{key}: expected a positive number of seconds, got {raw!r}"


def test_duration_error_matches_the_documented_format() -> None:
    assert only_problem({"load_timeout_s": "abc"}) == (
        "load_timeout_s: expected a positive number of seconds, got 'abc'"
    )


@pytest.mark.parametrize("key", [k for k in DURATION_KEYS if k != "tombstone_retention_s"])
def test_durations_are_capped_at_a_billion_seconds(key: str) -> None:
    if key != "heartbeat_interval_s":  # its timeout must be larger still
        assert getattr(TierConfig.from_dict(with_room(key, 1e9)), key) == 1e9
    assert only_problem(with_room(key, "1e10")) == (
        f"{key}: expected at most 1e+09 seconds, got '1e10'"
    )


def test_longest_load_timeout_still_derives_a_valid_tombstone() -> None:
    config = TierConfig.from_dict({"load_timeout_s": 1e9})
    assert config.tombstone_retention_s == 2e9
    assert TierConfig.from_dict(config.to_dict()) == config


@given(st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False))
def test_any_valid_duration_given_as_a_string_parses_to_the_same_value(seconds: float) -> None:
    for text in (repr(seconds), str(seconds), f" {seconds!r} "):
        config = TierConfig.from_dict({"store_timeout_s": text, "lookup_timeout_s": seconds})
        assert config.store_timeout_s == seconds == config.lookup_timeout_s


# -- counts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(0, 0), (1, 1), (65535, 65535), ("5710", 5710), (" 80 ", 80), (80.0, 80), ("80.0", 80)],
)
def test_port_accepts_integers_in_range(raw: object, expected: int) -> None:
    port = TierConfig.from_dict({"port": raw}).port
    assert port == expected
    assert type(port) is int


@pytest.mark.parametrize(
    "raw",
    [-1, 65536, "65536", 12.5, "12.5", True, "true", None, "abc", "", math.nan, math.inf, [1]],
)
def test_port_rejects_non_integers_and_out_of_range(raw: object) -> None:
    """0 is accepted: it binds any free port (the node then advertises the real one)."""
    assert only_problem({"port": raw}) == f"port: expected an integer from 0 to 65535, got {raw!r}"


@pytest.mark.parametrize("key", COUNT_KEYS)
@pytest.mark.parametrize(
    ("raw", "expected"), [(1, 1), ("128", 128), (12.0, 12), ("1e3", 1000), (10**6, 10**6)]
)
def test_counts_accept_integers(key: str, raw: object, expected: int) -> None:
    value = getattr(TierConfig.from_dict({key: raw}), key)
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize("key", COUNT_KEYS)
@pytest.mark.parametrize("raw", [0, -3, "0", 12.5, "12.5", False, True, "x", None, math.inf])
def test_counts_reject_non_integers_and_values_below_one(key: str, raw: object) -> None:
    assert only_problem({key: raw}) == f"{key}: expected an integer >= 1, got {raw!r}"


@given(st.integers(min_value=1, max_value=10**12))
def test_any_count_given_as_a_string_parses_to_the_same_int(count: int) -> None:
    assert TierConfig.from_dict({"max_peers": str(count)}).max_peers == count


# -- host and peer_id ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "host", "peer_id"),
    [
        ("127.0.0.1", "127.0.0.1", "127.0.0.1:5710"),
        ("::1", "::1", "[::1]:5710"),
        ("[::1]", "::1", "[::1]:5710"),
        ("0:0::0001", "::1", "[::1]:5710"),
        ("fd00::7", "fd00::7", "[fd00::7]:5710"),
        (" 10.0.0.2 ", "10.0.0.2", "10.0.0.2:5710"),
        ("node-a", "node-a", "node-a:5710"),
        ("Node-A.example.com", "Node-A.example.com", "Node-A.example.com:5710"),
        ("localhost", "localhost", "localhost:5710"),
    ],
)
def test_host_accepts_ip_literals_and_names(raw: str, host: str, peer_id: str) -> None:
    config = TierConfig.from_dict({"host": raw})
    assert config.host == host
    assert config.peer_id == peer_id


def test_peer_id_uses_the_port() -> None:
    assert TierConfig.from_dict({"host": "::1", "port": "6000"}).peer_id == "[::1]:6000"


@pytest.mark.parametrize(
    "raw", ["", "   ", None, 5, "a b", "-node", "node_.", "1.2.3.999", "[node]", "x" * 254]
)
def test_host_rejects_non_hosts(raw: object) -> None:
    assert only_problem({"host": raw}) == (
        f"host: expected an IP address or host name, got {raw!r}"
    )


@pytest.mark.parametrize("raw", ["0.0.0.0", "::", "[::]"])
def test_host_rejects_wildcards_peers_cannot_dial(raw: str) -> None:
    line = only_problem({"host": raw})
    assert line.startswith("host: wildcard address")
    assert repr(raw) in line


# -- data transports ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (["nixl", "tcp"], ("nixl", "tcp")),
        (["tcp"], ("tcp",)),
        ("shm,tcp", ("shm", "tcp")),
        (" tcp , shm ,", ("tcp", "shm")),
        ("nixl", ("nixl",)),
        (("shm", "nixl", "tcp"), ("shm", "nixl", "tcp")),
    ],
)
def test_data_transports_keep_preference_order(raw: object, expected: tuple[str, ...]) -> None:
    assert TierConfig.from_dict({"data_transports": raw}).data_transports == expected


@pytest.mark.parametrize("raw", [[], "", " , "])
def test_data_transports_must_not_be_empty(raw: object) -> None:
    line = only_problem({"data_transports": raw})
    assert line.startswith("data_transports: expected at least one of 'shm', 'tcp', 'nixl'")


def test_data_transports_name_unknown_and_duplicate_entries() -> None:
    lines = problems_of({"data_transports": "shm,udp,nxil,shm"})
    assert lines == [
        "data_transports: unknown transport 'udp'",
        "data_transports: unknown transport 'nxil' (did you mean 'nixl'?)",
        "data_transports: 'shm' is listed twice",
        "data_transports: known transports: 'shm', 'tcp', 'nixl'",
    ]


@pytest.mark.parametrize("raw", [5, None, {"shm": 1}, True])
def test_data_transports_reject_non_lists(raw: object) -> None:
    assert repr(raw) in only_problem({"data_transports": raw})


def test_data_transports_reject_non_string_entries() -> None:
    assert problems_of({"data_transports": ["tcp", 1]})[0] == (
        "data_transports: unknown transport 1"
    )


# -- allowed_peers: parsing ---------------------------------------------------------------


def test_allowed_peers_none_allows_everyone() -> None:
    allow = TierConfig.from_dict({"allowed_peers": None}).allowed_peers
    assert allow.everyone
    assert allow.allows("203.0.113.9", 1)
    assert allow.allows("anything", 65535)
    assert allow.to_entries() is None


def test_allowed_peers_parse_cidrs_and_host_ports() -> None:
    allow = TierConfig.from_dict(
        {"allowed_peers": ["10.1.2.3/8", "::1/128", "127.0.0.1:5710", "[::1]:5711", "Node-A:5710"]}
    ).allowed_peers
    assert not allow.everyone
    assert allow.networks == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
    )
    assert allow.endpoints == (("127.0.0.1", 5710), ("::1", 5711), ("node-a", 5710))
    assert allow.to_entries() == [
        "10.0.0.0/8",
        "::1/128",
        "127.0.0.1:5710",
        "[::1]:5711",
        "node-a:5710",
    ]


def test_allowed_peers_accept_a_comma_separated_string() -> None:
    from_string = TierConfig.from_dict({"allowed_peers": " 10.0.0.0/8 , [::1]:5710, node-a:1,"})
    from_list = TierConfig.from_dict({"allowed_peers": ["10.0.0.0/8", "[::1]:5710", "node-a:1"]})
    assert from_string == from_list


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ("::1:5710", "a bare address is ambiguous"),
        ("10.0.0.1", "write a CIDR ('10.0.0.1/32')"),
        ("::1", "write a CIDR ('::1/128')"),
        ("[::1]", "a bare address is ambiguous"),
        ("fe80::1:5710x", "an IPv6 host:port must be bracketed"),
        ("10.0.0.1/33", "invalid CIDR"),
        ("10.0.0.0/x", "invalid CIDR"),
        ("10.0.0.1:0", "expected a port from 1 to 65535"),
        ("node-a:65536", "expected a port from 1 to 65535"),
        ("node-a:", "expected a port from 1 to 65535"),
        ("node-a:http", "expected a port from 1 to 65535"),
        ("node-a", "expected a CIDR (e.g. '10.0.0.0/8') or host:port"),
        ("", "expected a CIDR"),
        ("a b:1", "expected a CIDR"),
        ("1.2.3.999:5", "expected a CIDR"),
        ("[node-a]:5710", "brackets are only for IPv6 addresses"),
        ("[10.0.0.1]:5710", "brackets are only for IPv6 addresses"),
    ],
)
def test_allowed_peers_reject_bad_entries(entry: str, fragment: str) -> None:
    line = only_problem({"allowed_peers": [entry]})
    assert line.startswith("allowed_peers: ")
    assert fragment in line
    assert repr(entry) in line


def test_allowed_peers_report_every_bad_entry() -> None:
    lines = problems_of({"allowed_peers": ["10.0.0.0/8", "node-a", 5, "[::1]:0"]})
    assert len(lines) == 3
    assert "'node-a'" in lines[0]
    assert lines[1] == "allowed_peers: expected each entry to be a string, got 5"
    assert "'[::1]:0'" in lines[2]


@pytest.mark.parametrize("raw", [[], "", " , "])
def test_allowed_peers_empty_list_is_rejected_not_deny_all(raw: object) -> None:
    assert "use null to allow every peer" in only_problem({"allowed_peers": raw})


@pytest.mark.parametrize("raw", [5, True, {"10.0.0.0/8": 1}])
def test_allowed_peers_reject_non_lists(raw: object) -> None:
    line = only_problem({"allowed_peers": raw})
    assert line.startswith("allowed_peers: expected null, a list")
    assert line.endswith(repr(raw))


def test_allow_list_from_entries_raises_config_error() -> None:
    assert AllowList.from_entries("10.0.0.0/8,node:1") == AllowList.from_entries(
        ["10.0.0.0/8", "node:1"]
    )
    with pytest.raises(ConfigError, match=r"allowed_peers: .*'nope'"):
        AllowList.from_entries(["nope"])


# -- allowed_peers: matching --------------------------------------------------------------


def allow(*entries: str) -> AllowList:
    return AllowList.from_entries(entries)


def test_ipv4_cidr_matches_contained_addresses_on_any_port() -> None:
    rules = allow("10.0.0.0/8")
    assert rules.allows("10.0.0.1", 1)
    assert rules.allows("10.255.255.255", 65535)
    assert not rules.allows("11.0.0.1", 5710)
    assert not rules.allows("node-a", 5710)


def test_ipv6_cidr_matches_contained_addresses() -> None:
    rules = allow("fd00::/8", "::1/128")
    assert rules.allows("fd12:3456::1", 5710)
    assert rules.allows("::1", 9)
    assert rules.allows("[::1]", 9)
    assert rules.allows("0:0:0:0:0:0:0:1", 9)
    assert not rules.allows("fe80::1", 5710)
    assert not rules.allows("127.0.0.1", 5710)


def test_ipv4_mapped_ipv6_addresses_match_ipv4_rules() -> None:
    rules = allow("10.0.0.0/8", "192.0.2.7:5710")
    assert rules.allows("::ffff:10.1.1.1", 5710)
    assert rules.allows("::ffff:192.0.2.7", 5710)
    assert not rules.allows("::ffff:192.0.2.7", 5711)


def test_ip_host_port_entry_matches_only_that_address_and_port() -> None:
    rules = allow("127.0.0.1:5710", "[::1]:5711")
    assert rules.allows("127.0.0.1", 5710)
    assert not rules.allows("127.0.0.1", 5711)
    assert not rules.allows("127.0.0.2", 5710)
    assert rules.allows("::1", 5711)
    assert rules.allows("0::1", 5711)
    assert not rules.allows("::1", 5710)
    assert not rules.allows("localhost", 5710)


def test_name_matches_only_host_port_entries_with_that_name() -> None:
    rules = allow("node-a:5710", "10.0.0.0/8")
    assert rules.allows("node-a", 5710)
    assert rules.allows("NODE-A", 5710)
    assert not rules.allows("node-a", 5711)
    assert not rules.allows("node-b", 5710)
    assert not rules.allows("node-a.example.com", 5710)


def test_default_allow_list_is_allow_all() -> None:
    assert AllowList.allow_all().allows("198.51.100.1", 7)
    assert not AllowList().allows("198.51.100.1", 7)


@given(st.ip_addresses(v=4), st.integers(min_value=0, max_value=32), st.integers(1, 65535))
def test_every_address_inside_a_cidr_is_allowed(
    address: ipaddress.IPv4Address, prefix: int, port: int
) -> None:
    network = ipaddress.ip_network(f"{address}/{prefix}", strict=False)
    rules = allow(str(network))
    assert rules.allows(str(address), port)
    assert rules.allows(str(network.network_address), port)
    assert rules.allows(str(network.broadcast_address), port)


@given(st.ip_addresses(v=6), st.integers(1, 65535))
def test_bracketed_ipv6_host_port_round_trips(address: ipaddress.IPv6Address, port: int) -> None:
    rules = allow(f"[{address.exploded}]:{port}")
    assert rules.allows(str(address), port)
    assert rules.to_entries() == [f"[{address}]:{port}"]
    assert allow(*(rules.to_entries() or [])) == rules


# -- hash_seed, config_fingerprint, curve -------------------------------------------------


@pytest.mark.parametrize("raw", [None, "0", "seed-1", "x" * 512])
def test_hash_seed_accepts_null_or_a_non_empty_string(raw: str | None) -> None:
    assert TierConfig.from_dict({"hash_seed": raw}).hash_seed == raw


@pytest.mark.parametrize("raw", ["", "  ", 0, 42, True, ["a"], "x" * 513])
def test_hash_seed_rejects_other_values(raw: object) -> None:
    line = only_problem({"hash_seed": raw})
    assert line.startswith("hash_seed: expected null or a non-empty string")
    assert line.endswith(repr(raw))


@pytest.mark.parametrize("raw", ["", "abc", "x" * 128])
def test_config_fingerprint_accepts_short_strings(raw: str) -> None:
    assert TierConfig.from_dict({"config_fingerprint": raw}).config_fingerprint == raw


@pytest.mark.parametrize("raw", [None, 5, "x" * 129, b"abc"])
def test_config_fingerprint_rejects_long_strings_and_non_strings(raw: object) -> None:
    assert only_problem({"config_fingerprint": raw}) == (
        f"config_fingerprint: expected a string of at most 128 characters, got {raw!r}"
    )


def test_curve_accepts_the_three_paths_without_touching_the_filesystem() -> None:
    config = TierConfig.from_dict({"curve": CURVE})
    assert config.curve == CurveConfig(**CURVE)
    assert config.to_dict()["curve"] == CURVE


@pytest.mark.parametrize("raw", ["keys/", ["a"], 5, True])
def test_curve_rejects_non_objects(raw: object) -> None:
    line = only_problem({"curve": raw})
    assert line.startswith("curve: expected null or an object with keys")
    assert line.endswith(repr(raw))


def test_curve_reports_every_key_problem() -> None:
    raw = {"server_secret_key_fil": "a", "server_public_key_file": "", "client_public_keys_dir": 3}
    assert problems_of({"curve": raw}) == [
        "curve: unknown key 'server_secret_key_fil' (did you mean 'server_secret_key_file'?)",
        "curve: missing key 'server_secret_key_file'",
        "curve: server_public_key_file: expected a non-empty path string, got ''",
        "curve: client_public_keys_dir: expected a non-empty path string, got 3",
    ]


# -- ordering rules -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("load", "expected"), [(None, 60.0), (45, 90.0), ("0.5", 1.0), ("600", 1200.0)]
)
def test_tombstone_defaults_to_twice_the_effective_load_timeout(
    load: object, expected: float
) -> None:
    mapping = {} if load is None else {"load_timeout_s": load}
    assert TierConfig.from_dict(mapping).tombstone_retention_s == expected


@pytest.mark.parametrize(("tombstone", "load"), [(30, 30), ("50", "100"), (1, 30)])
def test_tombstone_must_exceed_load_timeout(tombstone: int | str, load: int | str) -> None:
    line = only_problem({"tombstone_retention_s": tombstone, "load_timeout_s": load})
    assert line == (
        "tombstone_retention_s: must exceed load_timeout_s, got "
        f"tombstone_retention_s={float(tombstone)!r} and load_timeout_s={float(load)!r}"
    )


def test_explicit_tombstone_is_checked_against_the_default_load_timeout() -> None:
    assert "load_timeout_s=30.0" in only_problem({"tombstone_retention_s": 20})
    assert TierConfig.from_dict({"tombstone_retention_s": 31}).tombstone_retention_s == 31.0


def test_heartbeat_timeout_must_exceed_heartbeat_interval() -> None:
    assert only_problem({"heartbeat_interval_s": "10"}) == (
        "heartbeat_timeout_s: must exceed heartbeat_interval_s, got "
        "heartbeat_timeout_s=10.0 and heartbeat_interval_s=10.0"
    )
    config = TierConfig.from_dict({"heartbeat_interval_s": 10, "heartbeat_timeout_s": 30})
    assert (config.heartbeat_interval_s, config.heartbeat_timeout_s) == (10.0, 30.0)


def test_ordering_rules_are_skipped_when_a_side_is_already_invalid() -> None:
    assert problems_of({"load_timeout_s": "abc", "tombstone_retention_s": 1}) == [
        "load_timeout_s: expected a positive number of seconds, got 'abc'"
    ]
    assert len(problems_of({"heartbeat_interval_s": 50, "heartbeat_timeout_s": True})) == 1


# -- unknown keys and collected problems --------------------------------------------------


def test_unknown_key_gets_a_did_you_mean_suggestion() -> None:
    assert only_problem({"load_timout_s": 5}) == (
        "unknown key 'load_timout_s' (did you mean 'load_timeout_s'?)"
    )


def test_every_unknown_key_is_listed() -> None:
    assert problems_of({"hots": "x", "prot": 1, "zzz": 1, 7: 1}) == [
        "unknown key 'hots' (did you mean 'host'?)",
        "unknown key 'prot' (did you mean 'port'?)",
        "unknown key 'zzz'",
        "unknown key 7",
    ]


@pytest.mark.parametrize("key", ["type", "module_path"])
def test_connector_keys_must_be_stripped_by_the_caller(key: str) -> None:
    assert "strip 'type' and 'module_path' first" in only_problem({key: "KVPeerTier"})


def test_all_problems_are_reported_at_once_one_per_line() -> None:
    mapping = {
        "lookup_timout_s": 5,
        "port": "http",
        "load_timeout_s": True,
        "max_peers": 12.5,
        "data_transports": "shm,rdma",
        "allowed_peers": ["node-a"],
        "heartbeat_interval_s": 20,
    }
    lines = problems_of(mapping)
    assert len(lines) == 8  # data_transports adds the list of known names
    assert lines[0] == "unknown key 'lookup_timout_s' (did you mean 'lookup_timeout_s'?)"
    for key in ("port", "load_timeout_s", "max_peers", "data_transports", "allowed_peers"):
        assert any(line.startswith(f"{key}: ") for line in lines), key
    assert lines[-1].startswith("heartbeat_timeout_s: must exceed heartbeat_interval_s")


@pytest.mark.parametrize("raw", [None, [], "host=x", 5])
def test_non_mapping_config_is_one_problem(raw: object) -> None:
    assert validate_dict(raw) == [f"tier config: expected a mapping of keys to values, got {raw!r}"]


# -- direct construction, round trip, session settings ------------------------------------


def test_direct_construction_is_validated_and_canonical() -> None:
    assert TierConfig(host="0:0::1").peer_id == "[::1]:5710"
    with pytest.raises(ConfigError, match="tombstone_retention_s: must exceed load_timeout_s"):
        TierConfig(load_timeout_s=100.0)
    with pytest.raises(ConfigError, match=r"port: .*70000"):
        dataclasses.replace(TierConfig(), port=70000)
    assert dataclasses.replace(TierConfig(), port=0).port == 0  # any free port
    widened = dataclasses.replace(TierConfig(), load_timeout_s=100.0, tombstone_retention_s=200.0)
    assert widened.load_timeout_s == 100.0


def test_to_dict_is_json_and_round_trips() -> None:
    mapping = {
        "host": "::1",
        "port": "6001",
        "load_timeout_s": "45",
        "abort_ack_timeout_s": 3,
        "lookup_pending_timeout_s": 1.5,
        "lookup_timeout_s": 20,
        "store_timeout_s": 25,
        "unbound_store_timeout_s": 90,
        "handshake_timeout_s": 5,
        "abort_drain_timeout_s": 2,
        "heartbeat_interval_s": "0.5",
        "heartbeat_timeout_s": 4,
        "max_peers": "8",
        "max_queued_messages": 100.0,
        "data_transports": "tcp,shm",
        "allowed_peers": "10.0.0.0/8, [fd00::1]:6001, node-b:6002",
        "hash_seed": "1234",
        "config_fingerprint": "llama-7b/bs32",
        "curve": CURVE,
    }
    config = TierConfig.from_dict(mapping)
    dumped = config.to_dict()
    assert set(dumped) == {f.name for f in dataclasses.fields(TierConfig)}
    assert dumped["tombstone_retention_s"] == 90.0
    assert dumped["data_transports"] == ["tcp", "shm"]
    assert dumped["allowed_peers"] == ["10.0.0.0/8", "[fd00::1]:6001", "node-b:6002"]
    assert TierConfig.from_dict(json.loads(json.dumps(dumped))) == config
    assert TierConfig.from_dict(TierConfig().to_dict()) == TierConfig()


durations = st.floats(min_value=0.001, max_value=1e6, allow_nan=False, allow_infinity=False)
as_given = st.one_of(st.just(lambda v: v), st.just(str), st.just(lambda v: f" {v} "))


@st.composite
def valid_configs(draw: st.DrawFn) -> dict[str, object]:
    mapping: dict[str, object] = {}
    for key in DURATION_KEYS:
        if key not in ("tombstone_retention_s", "heartbeat_timeout_s") and draw(st.booleans()):
            mapping[key] = draw(as_given)(draw(durations))
    if draw(st.booleans()):
        mapping["tombstone_retention_s"] = 2e6 + draw(durations)
    mapping["heartbeat_timeout_s"] = 2e6 + draw(durations)
    mapping["port"] = draw(as_given)(draw(st.integers(1, 65535)))
    mapping["max_peers"] = draw(st.integers(1, 10_000))
    mapping["data_transports"] = draw(st.permutations(DATA_TRANSPORTS))[: draw(st.integers(1, 3))]
    nets = draw(st.lists(st.ip_addresses(), max_size=3))
    mapping["allowed_peers"] = [f"{a}/{a.max_prefixlen}" for a in nets] or None
    return mapping


@given(valid_configs())
def test_round_trip_holds_for_any_valid_config(mapping: dict[str, object]) -> None:
    config = TierConfig.from_dict(mapping)
    assert TierConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_session_settings_carry_the_matching_durations() -> None:
    config = TierConfig.from_dict(
        {
            "load_timeout_s": 11,
            "abort_ack_timeout_s": 12,
            "lookup_timeout_s": 13,
            "lookup_pending_timeout_s": 14,
            "store_timeout_s": 15,
            "abort_drain_timeout_s": 16,
            "handshake_timeout_s": 17,
            "max_queued_messages": "18",
        }
    )
    assert config.session_settings() == SessionSettings(
        load_timeout_s=11.0,
        abort_ack_timeout_s=12.0,
        lookup_timeout_s=13.0,
        lookup_pending_timeout_s=14.0,
        store_timeout_s=15.0,
        abort_drain_timeout_s=16.0,
        transfer_timeout_s=23.0,  # load + abort_ack: the consumer has given up by then
        handshake_timeout_s=17.0,
        max_queued_messages=18,
    )
    assert TierConfig().session_settings() == SessionSettings()


class TestUntrustedPeerKeys:
    """The keys that bound what a peer can make a node do (issue 15)."""

    def test_defaults(self) -> None:
        config = TierConfig()
        assert config.max_peer_bytes == 64 << 20
        assert config.max_handshakes_per_source == 8
        assert config.trust_peer_addresses is False
        assert config.session_settings().max_peer_bytes == 64 << 20

    @pytest.mark.parametrize(
        ("given", "parsed"), [(True, True), ("false", False), (" TRUE ", True)]
    )
    def test_trust_peer_addresses_takes_booleans(self, given: object, parsed: bool) -> None:
        assert TierConfig.from_dict({"trust_peer_addresses": given}).trust_peer_addresses is parsed

    @pytest.mark.parametrize("given", [1, 0, "yes", None, "on"])
    def test_trust_peer_addresses_refuses_anything_else(self, given: object) -> None:
        with pytest.raises(ConfigError, match=r"trust_peer_addresses: expected true or false"):
            TierConfig.from_dict({"trust_peer_addresses": given})

    def test_a_budget_under_one_mebibyte_is_refused(self) -> None:
        with pytest.raises(ConfigError, match=r"max_peer_bytes: expected an integer >= 1048576"):
            TierConfig.from_dict({"max_peer_bytes": 4096})
        with pytest.raises(ConfigError, match=r"max_handshakes_per_source"):
            TierConfig.from_dict({"max_handshakes_per_source": 0})


# -- how long the engine may wait for a pull ------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [(0, 0.0), ("0", 0.0), (0.05, 0.05), ("1", 1.0)])
def test_sync_pull_wait_accepts_zero_to_one_second(raw: object, expected: float) -> None:
    assert TierConfig.from_dict({"sync_pull_wait_s": raw}).sync_pull_wait_s == expected


def test_sync_pull_wait_defaults_to_fifty_milliseconds() -> None:
    assert TierConfig().sync_pull_wait_s == 0.05


@pytest.mark.parametrize("raw", [-0.01, 1.5, "2", True, None, "soon", math.nan, math.inf])
def test_sync_pull_wait_rejects_what_would_stall_the_engine(raw: object) -> None:
    assert only_problem({"sync_pull_wait_s": raw}) == (
        f"sync_pull_wait_s: expected 0 to 1 seconds, got {raw!r}"
    )


# -- how long a peer waits for a busy engine (kvpeer.node.enginewait) -------------------


@pytest.mark.parametrize(("raw", "expected"), [(None, None), (0, 0.0), ("0.5", 0.5), (60, 60.0)])
def test_engine_wait_accepts_seconds_or_null(raw: object, expected: float | None) -> None:
    assert TierConfig.from_dict({"engine_wait_s": raw}).engine_wait_s == expected


def test_engine_wait_defaults_to_a_quarter_second() -> None:
    assert TierConfig().engine_wait_s == 0.25


@pytest.mark.parametrize("raw", [-0.01, 2e9, True, "soon", math.nan, math.inf])
def test_engine_wait_rejects_a_bad_value_by_name(raw: object) -> None:
    assert only_problem({"engine_wait_s": raw}) == (
        f"engine_wait_s: expected null or 0 to 1e+09 seconds, got {raw!r}"
    )


# -- the fast paths are the defaults (held blocks, pulling ahead) -----------------------

MIB = 1 << 20


def test_held_bytes_default_is_a_quarter_of_the_region_at_most_4_gib() -> None:
    config = TierConfig()
    assert config.held_bytes is None
    assert config.held_bytes_for(256 * MIB, 24 * 1024) == (64 * MIB) // (24 * 1024) * 24 * 1024
    assert config.held_bytes_for(64 << 30, MIB) == 4 << 30  # bounded
    assert config.held_bytes_for(3 * 4096, 4096) == 0  # less than a block: nothing held


def test_held_bytes_given_is_used_as_is_and_zero_turns_holding_off() -> None:
    assert TierConfig.from_dict({"held_bytes": 0}).held_bytes_for(256 * MIB, 4096) == 0
    given = TierConfig.from_dict({"held_bytes": "1048576"})
    assert given.held_bytes_for(256 * MIB, 4096) == MIB
    assert given.held_bytes_for(256 * MIB, 1000 * 1000) == 1000 * 1000  # whole blocks only
    assert validate_dict({"held_bytes": -1}) == ["held_bytes: expected an integer >= 0, got -1"]


def test_an_open_node_obeys_prefetches_from_its_own_loopback_only() -> None:
    trusted = TierConfig().prefetch_trusted()
    assert trusted.allows_source("127.0.0.1")
    assert trusted.allows_source("127.3.0.9")
    assert trusted.allows_source("::1")
    assert trusted.allows_source("::ffff:127.0.0.1")
    for outsider in ("10.0.0.5", "192.168.1.7", "::2", "0.0.0.0"):
        assert not trusted.allows_source(outsider), outsider


def test_an_allow_listed_node_obeys_prefetches_from_its_allowed_peers() -> None:
    config = TierConfig.from_dict({"allowed_peers": ["10.0.0.0/16"]})
    trusted = config.prefetch_trusted()
    assert trusted.allows_source("10.0.3.4")
    assert not trusted.allows_source("10.1.0.1")
    assert not trusted.allows_source("127.0.0.1")  # not even loopback: the list is the fleet


def test_prefetch_from_given_overrides_the_rule_and_an_empty_list_turns_it_off() -> None:
    given = TierConfig.from_dict(
        {"prefetch_from": ["192.0.2.1/32"], "allowed_peers": ["10.0.0.0/8"]}
    )
    assert given.prefetch_trusted().allows_source("192.0.2.1")
    assert not given.prefetch_trusted().allows_source("10.0.0.1")
    off = TierConfig.from_dict({"prefetch_from": []})
    assert off.prefetch_trusted().nobody
    assert off.to_dict()["prefetch_from"] == []
    assert TierConfig.from_dict(off.to_dict()) == off
    assert TierConfig().to_dict()["prefetch_from"] is None
    assert TierConfig.from_dict(TierConfig().to_dict()) == TierConfig()
