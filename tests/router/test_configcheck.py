"""The router's configuration checked as the tier's is: every problem at once, the closest
known key for an unknown one, a bad flag blamed on the flag; ``kvpeer check-config`` reads
router TOML files too."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpeer.errors import ConfigError
from kvpeer.router import config, configcheck

GOOD_ENGINE = {"name": "a", "url": "http://10.0.0.1:8000", "peer": "10.0.0.1:5710"}
GOOD: dict[str, Any] = {"mode": "shared", "listen": "0.0.0.0:8000",
                        "engine": [GOOD_ENGINE, {"name": "b", "url": "http://10.0.0.2:8000",
                                                 "peer": "10.0.0.2:5710"}]}  # fmt: skip

# One bad thing each: (what to change, a word the problem line must hold).
BAD: list[tuple[dict[str, Any], str]] = [
    ({"retires": 2}, "did you mean 'retries'"),
    ({"mode": "both"}, "'both' is not one of"),
    ({"listen": "0.0.0.0"}, "not host:port"),
    ({"retries": 11}, "retries: 11 must be within 0..10"),
    ({"retries": "x"}, "'x' is not an integer"),
    ({"health_timeout_s": 0}, "health_timeout_s: 0"),
    ({"health_restart_failures": 0}, "health_restart_failures"),
    ({"engine_step_tokens": 0}, "engine_step_tokens"),
    ({"load_scrape_interval_s": -1}, "load_scrape_interval_s"),
    ({"max_body_bytes": 10}, "max_body_bytes"),
    ({"policy": "random"}, "'random' is not one of"),
    ({"tokenize": "yes"}, "is not true/false"),
    ({"prefetch_curve_key": "k"}, "give both"),
    ({"mode": "pd", "policy": "affinity"}, "'affinity' never pulls"),
    ({"engine": [GOOD_ENGINE, GOOD_ENGINE]}, "duplicate engine name"),
    ({"engine": [{**GOOD_ENGINE, "url": "ftp://x"}]}, "is not an http(s)"),
    ({"engine": [{**GOOD_ENGINE, "rolle": "both"}]}, "did you mean 'role'"),
    ({"engine": [{**GOOD_ENGINE, "kv_events": "tcp://*:5557"}]}, "bind address"),
    ({"engine": [{**GOOD_ENGINE, "role": "prefill"}]}, "means nothing in shared mode"),
    ({"engine": [{**GOOD_ENGINE, "dp_size": 2, "url": ["http://h:1"]}]}, "dp_size is 2"),
    ({"engine": [{"url": "http://h:1", "peer": "h:2"}]}, "name is missing"),
    ({"engine": []}, "no engines"),
    ({"discovery": {"dns": "x", "intervl_s": 3}}, "did you mean 'interval_s'"),
]


@pytest.mark.parametrize(("change", "words"), BAD)
def test_each_problem_is_found_and_from_mapping_agrees(change: dict[str, Any], words: str) -> None:
    mapping = GOOD | change
    found = configcheck.problems(mapping, "router.toml")
    assert any(words in line for line in found), found
    assert all(line.startswith("router.toml: ") for line in found), found
    with pytest.raises(ConfigError):
        config.from_mapping(mapping, "router.toml")


def test_a_good_config_has_no_problem() -> None:
    assert configcheck.problems(GOOD, "router.toml") == []
    config.from_mapping(GOOD)


def test_every_problem_is_reported_at_once() -> None:
    mapping: dict[str, Any] = GOOD.copy()
    changes = [change for change, _ in BAD[:12]
               if "mode" not in change and "listen" not in change]  # fmt: skip
    for change in changes:
        mapping |= change
    mapping["engine"] = [{**GOOD_ENGINE, "url": "ftp://x", "peer": "nohost", "rolle": 1}]
    found = configcheck.problems(mapping, "router.toml")
    for key in ("retires", "retries", "health_timeout_s", "health_restart_failures",
                "engine_step_tokens", "load_scrape_interval_s", "max_body_bytes", "policy",
                "tokenize", "rolle", "url", "peer"):  # fmt: skip
        assert any(key in line for line in found), (key, found)
    # From_mapping, the first only:
    with pytest.raises(ConfigError) as first:
        config.from_mapping(mapping, "router.toml")
    assert len(str(first.value).splitlines()) == 1


def parse(tmp_path: Path, toml: str, *flags: str) -> config.RouterConfig:
    path = tmp_path / "router.toml"
    path.write_text(toml)
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return configcheck.from_args(parser.parse_args(["--config", str(path), *flags]))


def test_a_bad_flag_is_blamed_on_the_flag_not_the_file(tmp_path: Path) -> None:
    toml = ('retries = 1\n[[engine]]\nname = "a"\nurl = "http://10.0.0.1:8000"\n'
            'peer = "10.0.0.1:5710"\n')  # fmt: skip
    assert parse(tmp_path, toml).retries == 1
    assert parse(tmp_path, toml, "--retries", "3").retries == 3  # flags override the file
    with pytest.raises(ConfigError) as caught:
        parse(tmp_path, toml, "--retries", "x", "--health-timeout", "-1", "--no-tokenize",
              "--engine", "b=http://10.0.0.2:8000,peer=10.0.0.2:5710,helt=true")
    lines = str(caught.value).splitlines()
    assert "--retries: 'x' is not an integer" in lines
    assert any(line.startswith("--health-timeout: -1") for line in lines), lines
    assert any(line.startswith("--engine 'b=") and "did you mean 'held'" in line
               for line in lines)  # fmt: skip
    assert not any("router.toml" in line for line in lines)  # the file is fine


def test_every_flag_that_sets_a_key_is_known() -> None:
    names = configcheck.flag_names()
    assert names["retries"] == "--retries"
    assert names["tokenize"] == "--no-tokenize"
    assert names["health_timeout_s"] == "--health-timeout"
    # Every key a flag sets is a key of the file.
    assert set(names) <= set(configcheck.TOP_LEVEL_KEYS)


def test_the_engine_flags_help_names_every_engine_key() -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    (engine,) = [a for a in parser._actions if a.dest == "engine"]
    assert engine.help is not None
    for key in config.ENGINE_KEYS - {"name", "url"}:
        assert f"{key}=" in engine.help, key


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpeer", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def test_check_config_reads_a_router_toml(tmp_path: Path) -> None:
    good = tmp_path / "router.toml"
    good.write_text('[[engine]]\nname = "a"\nurl = "http://10.0.0.1:8000"\n'
                    'peer = "10.0.0.1:5710"\n')
    result = check_config(good)
    assert (result.returncode, result.stdout.strip()) == (0, f"{good}: ok")
    bad = tmp_path / "bad.toml"
    bad.write_text('retries = 99\nmod = "pd"\n[[engine]]\nname = "a"\nurl = "x"\npeer = "h:1"\n')
    result = check_config(bad)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert f"{bad}: unknown key 'mod' (did you mean 'mode'?)" in lines
    assert f"{bad}: retries: 99 must be within 0..10" in lines
    assert any("url 'x'" in line for line in lines)
    broken = tmp_path / "broken.toml"
    broken.write_text("retries = = 1\n")
    result = check_config(broken)
    assert result.returncode == 2
    assert "not valid TOML" in result.stderr
    assert "Traceback" not in result.stderr
