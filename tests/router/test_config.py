"""Router configuration: TOML and flags in, one validated object or one clear error out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpeer.cli import build_parser
from kvpeer.errors import ConfigError
from kvpeer.router.config import from_args, from_mapping, parse_engine_flag
from kvpeer.router.policy import Mode, Role

TOML = """
mode = "pd"
listen = "0.0.0.0:9000"
retries = 1
health_interval_s = "0.5"

[[engine]]
name = "prefill"
url = "http://10.1.0.1:8100"
peer = "10.1.0.1:5710"
role = "prefill"
kv_events = "tcp://10.1.0.1:5557"

[[engine]]
name = "decode"
url = ["http://10.1.0.2:8100", "http://10.1.0.2:8101"]
peer = "10.1.0.2:5710"
role = "decode"
dp_size = 2
"""


def engines(*tables: dict[str, Any]) -> dict[str, Any]:
    return {"mode": "shared", "engine": list(tables)}


def engine(name: str = "e0", **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": "http://127.0.0.1:8100", "peer": "127.0.0.1:5710", **extra}


def test_toml_file_with_dp_ranks(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(TOML)
    config = from_args(build_parser().parse_args(["router", "--config", str(path)]))
    assert config.mode is Mode.PD
    assert (config.listen_host, config.listen_port) == ("0.0.0.0", 9000)
    assert config.retries == 1
    assert config.health_interval_s == 0.5
    assert [e.name for e in config.engines] == ["prefill", "decode-dp0", "decode-dp1"]
    decode1 = config.entry("decode-dp1")
    assert decode1.spec.url == "http://10.1.0.2:8101"
    assert decode1.spec.peer == "10.1.0.2:5711"
    assert decode1.spec.role is Role.DECODE
    assert decode1.headers() == {}  # its own URL: no rank header
    assert config.entry("prefill").spec.kv_events == "tcp://10.1.0.1:5557"


def test_one_url_for_several_ranks_sends_the_rank_header() -> None:
    config = from_mapping(engines(engine(dp_size=3)))
    assert [e.spec.peer_port for e in config.engines] == [5710, 5711, 5712]
    assert config.entry("e0-dp2").headers() == {"X-data-parallel-rank": "2"}


def test_flags_add_engines_and_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(TOML)
    args = build_parser().parse_args([
        "router", "--config", str(path), "--listen", "127.0.0.1:0", "--retries", "0",
        "--engine", "extra=http://10.1.0.3:8100,peer=10.1.0.3:5710,role=both",
        "--no-tokenize",
    ])
    config = from_args(args)
    assert config.listen_port == 0
    assert config.retries == 0
    assert config.tokenize is False
    assert config.entry("extra").spec.role is Role.BOTH


def test_engine_flag_parses() -> None:
    assert parse_engine_flag("a=http://h:1,peer=h:2,role=decode,dp_size=2") == {
        "name": "a", "url": "http://h:1", "peer": "h:2", "role": "decode", "dp_size": "2"}


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        (engines(engine("a"), engine("a", url="http://h:2", peer="h:3")),
         "'a': duplicate engine name"),
        (engines(engine(url="ftp://h:1")), "ftp://h:1"),
        (engines(engine(url="http://h:99999")), "http://h:99999"),
        (engines(engine(url="http://h:1/v1")), "without a path"),
        (engines(engine(peer="h:0")), "port 0 out of range"),
        (engines(engine(peer="h:65536")), "port 65536 out of range"),
        (engines(engine(peer="nohost")), "'nohost' is not host:port"),
        (engines(engine(peer="h:65535", dp_size=2)), "beyond 65535"),
        (engines(engine(url=["http://h:1"], dp_size=2)), "lists 1 URLs but dp_size is 2"),
        (engines(engine(role="prefill")), "role 'prefill' means nothing in shared mode"),
        (engines(engine(role="leader")), "role 'leader' is not one of"),
        (engines(engine(colour="red")), "unknown key(s) ['colour']"),
        (engines(engine("a"), engine("b", url="http://h:2")), "peer 127.0.0.1:5710 is also"),
        (engines(engine("a"), engine("b", peer="h:1")), "is also engine 'a'"),
        ({"mode": "pd", "engine": [engine("a", role="decode"), engine(
            "b", role="decode", url="http://h:2", peer="h:3")]}, "prefill: none"),
        ({"mode": "pd", "engine": [engine("a")]}, "mode pd needs"),
        ({"mode": "both", "engine": [engine()]}, "mode 'both' is not one of"),
        ({"engine": []}, "no engines"),
        ({**engines(engine()), "retries": True}, "retries: True is not a number"),
        ({**engines(engine()), "retries": 1.5}, "retries: 1.5 is not an integer"),
        ({**engines(engine()), "health_timeout_s": -1}, "health_timeout_s: -1"),
        ({**engines(engine()), "listen": "h:70000"}, "port 70000 out of range"),
        ({**engines(engine()), "retry": 2}, "unknown key(s) ['retry']"),
        ({**engines(engine()), "prefill_timeout_s": 0}, "prefill_timeout_s: 0"),
        ({**engines(engine()), "allow_pinning": "yes"}, "allow_pinning: 'yes'"),
        ({**engines(engine()), "engine_step_tokens": 0}, "engine_step_tokens: 0 must be"),
        ({**engines(engine()), "engine_step_tokens": 1.5}, "engine_step_tokens: 1.5 is not"),
        ({**engines(engine()), "policy": "nearest"}, "policy: 'nearest' is not one of pull"),
        ({**engines(engine()), "policy": 1}, "policy: 1 is not a string"),
        (engines(engine(held="yes")), "held: 'yes' is not true/false"),
        (engines(engine(held=1)), "held: 1 is not true/false"),
        ({"mode": "pd", "policy": "affinity", "engine": [engine("a", role="prefill"), engine(
            "b", role="decode", url="http://h:2", peer="h:3")]}, "'affinity' never pulls"),
    ],
)
def test_bad_config_names_the_bad_value(mapping: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping(mapping)
    assert message in str(caught.value)


def test_bad_toml_and_missing_file_are_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("mode = ")
    for path in (bad, tmp_path / "missing.toml"):
        with pytest.raises(ConfigError, match=str(path.name)):
            from_args(build_parser().parse_args(["router", "--config", str(path)]))


def test_bad_engine_flag() -> None:
    with pytest.raises(ConfigError, match="expected NAME=URL"):
        parse_engine_flag("http://h:1,peer=h:2")
    with pytest.raises(ConfigError, match="'role' is not key=value"):
        parse_engine_flag("a=http://h:1,peer=h:2,role")


def test_the_engines_step_budget_reaches_the_cost_model() -> None:
    """A busy source answers between two steps: the router predicts that wait from the
    engines' step budget, which the operator gives when it is not vLLM's default."""
    from kvpeer.router.app import Router
    from kvpeer.router.decide import RouterPolicy

    default = from_mapping(engines(engine()))
    small = from_mapping({**engines(engine()), "engine_step_tokens": 512})
    assert (default.engine_step_tokens, small.engine_step_tokens) == (2048, 512)
    for config, step in ((default, 2048), (small, 512)):
        policy = Router(config).policy
        assert isinstance(policy, RouterPolicy)
        assert policy.cost.priors.step_tokens == step


def test_the_policy_chooses_the_decision_core() -> None:
    """``pull`` (default) and ``affinity`` run the KV-aware core, the latter without pulls;
    ``load`` routes by load alone and subscribes to no KV events."""
    from kvpeer.router.app import Router
    from kvpeer.router.decide import RouterPolicy
    from kvpeer.router.loadonly import LoadOnlyPolicy

    events = engines(engine(kv_events="tcp://127.0.0.1:1"))
    by_flag = from_args(build_parser().parse_args(
        ["router", "--policy", "affinity", "--engine",
         "a=http://h:1,peer=h:2,kv_events=tcp://127.0.0.1:1"]))  # fmt: skip
    assert by_flag.policy == "affinity"
    for policy, core, pulls in (("pull", RouterPolicy, True), ("affinity", RouterPolicy, False)):
        router = Router(from_mapping({**events, "policy": policy}))
        assert isinstance(router.policy, core)
        assert router.policy._config.pulls is pulls
        assert set(router.subscribers) == {"e0"}
    load = Router(from_mapping({**events, "policy": "load"}))
    assert isinstance(load.policy, LoadOnlyPolicy)
    assert load.index is None
    assert load.subscribers == {}
    assert from_mapping(engines(engine())).policy == "pull"


def test_an_engine_that_serves_held_blocks_is_named_in_the_file_or_the_flag() -> None:
    assert from_mapping(engines(engine(held=True))).engines[0].spec.serves_held
    assert not from_mapping(engines(engine(held=False))).engines[0].spec.serves_held
    by_flag = from_args(build_parser().parse_args(
        ["router", "--engine", "a=http://h:1,peer=h:2,held=true",
         "--engine", "b=http://h:3,peer=h:4,held=false"]))  # fmt: skip
    assert [e.spec.serves_held for e in by_flag.engines] == [True, False]


def test_an_engine_running_kvpeers_connector_is_named_in_the_file_or_the_flag() -> None:
    assert from_mapping(engines(engine(sync_pulls=True))).engines[0].spec.sync_pulls
    assert not from_mapping(engines(engine(sync_pulls=False))).engines[0].spec.sync_pulls
    by_flag = from_args(build_parser().parse_args(
        ["router", "--engine", "a=http://h:1,peer=h:2,sync_pulls=true",
         "--engine", "b=http://h:3,peer=h:4,sync_pulls=false"]))  # fmt: skip
    assert [e.spec.sync_pulls for e in by_flag.engines] == [True, False]
    with pytest.raises(ConfigError, match="sync_pulls"):
        from_mapping(engines(engine(sync_pulls="often")))


def test_an_engine_that_pulls_ahead_gets_the_routers_prefetches() -> None:
    """``ahead`` in a table or a flag; a shared-mode router with such an engine opens a
    prefetch sender, one without (or a pd router) does not."""
    from kvpeer.router.app import Router

    table = from_mapping(engines(engine(ahead=True)))
    assert table.engines[0].spec.pulls_ahead
    flag = parse_engine_flag("a=http://h:1,peer=h:2,ahead=true")
    assert flag["ahead"] == "true"
    assert from_mapping(engines(flag)).engines[0].spec.pulls_ahead
    assert Router(table).ahead is not None
    assert Router(from_mapping(engines(engine(ahead=False)))).ahead is None
    with pytest.raises(ConfigError, match="ahead"):
        from_mapping(engines(engine(ahead="sometimes")))


def test_a_kvpeer_engine_gets_the_fast_paths_by_default_and_a_vllm_p2p_one_none() -> None:
    """An engine named with only url and peer (the README's router) is taken for a kvpeer
    tier as the README starts it: held blocks, kvpeer's connector, pulling ahead; its own
    keys override each; ``tier=vllm-p2p`` (vLLM's own tier) turns all three off."""
    default = from_mapping(engines(engine())).engines[0].spec
    assert (default.serves_held, default.sync_pulls, default.pulls_ahead) == (True, True, True)
    p2p = from_mapping(engines(engine(tier="vllm-p2p"))).engines[0].spec
    assert (p2p.serves_held, p2p.sync_pulls, p2p.pulls_ahead) == (False, False, False)
    mixed = from_mapping(engines(engine(tier="vllm-p2p", sync_pulls=True))).engines[0].spec
    assert (mixed.serves_held, mixed.sync_pulls) == (False, True)
    by_flag = from_args(build_parser().parse_args(
        ["router", "--engine", "a=http://h:1,peer=h:2,tier=vllm-p2p"]))  # fmt: skip
    assert not by_flag.engines[0].spec.pulls_ahead
    with pytest.raises(ConfigError, match="tier 'sglang' is not one of"):
        from_mapping(engines(engine(tier="sglang")))


def test_prefetch_curve_keys_come_both_or_neither(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="give both"):
        from_mapping({**engines(engine(ahead=True)), "prefetch_curve_key": "/k/router.key"})
    args = build_parser().parse_args(
        ["router", "--engine", "a=http://h:1,peer=h:2,ahead=true",
         "--prefetch-curve-key", str(tmp_path / "nope.key_secret"),
         "--prefetch-curve-server-key", str(tmp_path / "nope.key")])  # fmt: skip
    config = from_args(args)
    assert config.prefetch_curve_key.endswith("nope.key_secret")
    from kvpeer.router.app import Router

    with pytest.raises(ConfigError, match="prefetch_curve_key: cannot load"):
        Router(config)
