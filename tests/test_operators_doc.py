"""docs/operators.md's command lines and files are the ones that work: the tier config in
its ``vllm serve`` line passes ``kvpeer check-config --device cuda``, its router command
line and ``router.toml`` pass the router's checks and name the engines as the engines'
lines configure them. (tests/vllm/test_operators_doc.py hands the ``vllm serve`` line to
vLLM's own parser.)"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import tomllib
from pathlib import Path

from kvpeer.checkconfig import check_transfer_config
from kvpeer.router import config, configcheck

DOC = Path(__file__).resolve().parent.parent / "docs" / "operators.md"
#: The doc's engines: name -> address (the serve line is written for ``a``; ``b`` is "the
#: same with 10.0.0.6").
ENGINES = {"a": "10.0.0.5", "b": "10.0.0.6"}


def blocks(language: str) -> list[str]:
    """The doc's fenced code blocks in ``language``."""
    text = DOC.read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def shell_lines(block: str) -> list[str]:
    """A shell block's commands: split at newlines outside quotes, ``\\`` continuations
    joined (a quoted JSON argument may span lines)."""
    lines, current, quote = [], "", ""
    text = block.replace("\\\n", " ")
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "\n":
            lines.append(current)
            current = ""
            continue
        current += char
    return [line for line in [*lines, current] if line.strip()]


def commands(program: str) -> list[list[str]]:
    """Each shell command of the doc that runs ``program``, as argv (environment
    assignments first, as the shell reads them)."""
    found = []
    for block in blocks("sh"):
        for command in shell_lines(block):
            argv = shlex.split(command, comments=True)
            words = [w for w in argv if not re.fullmatch(r"[A-Z_]+=\S*", w)]
            if words[: len(program.split())] == program.split():
                found.append(argv)
    return found


def serve_line(engine: str = "a") -> list[str]:
    """The ``vllm serve`` argv for ``engine`` (``b``: the doc's line with its address)."""
    (argv,) = commands("vllm serve")
    return [word.replace(ENGINES["a"], ENGINES[engine]) for word in argv]


def option(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, name
    return argv[argv.index(name) + 1]


def test_the_serve_line_sets_the_hash_seed_and_a_gpu_tier_config() -> None:
    argv = serve_line()
    assert "PYTHONHASHSEED=0" in argv[: argv.index("vllm")]
    transfer = json.loads(option(argv, "--kv-transfer-config"))
    assert check_transfer_config(transfer, device="cuda") == []
    extra = transfer["kv_connector_extra_config"]
    assert extra["spec_name"] == "KVPeerTieringOffloadingSpec"
    assert extra["self_describing_kv_events"] is True
    assert "--enable-prompt-tokens-details" in argv
    # Nothing set by hand that has a fleet default now (the page says so).
    (tier,) = extra["secondary_tiers"]
    assert not {"held_bytes", "prefetch_from"} & set(tier)


def router_from_flags() -> config.RouterConfig:
    (argv,) = commands("kvpeer router")
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return configcheck.from_args(parser.parse_args(argv[2:]))


def test_the_router_names_each_engine_as_its_serve_line_configures_it() -> None:
    from_flags = router_from_flags()
    (toml,) = blocks("toml")
    mapping = tomllib.loads(toml)
    assert configcheck.problems(mapping, "router.toml") == []
    from_file = config.from_mapping(mapping, "router.toml")
    assert from_file.specs == from_flags.specs
    assert (from_file.mode, from_file.listen_port) == (from_flags.mode, from_flags.listen_port)
    for spec in from_flags.specs:
        argv = serve_line(spec.name)
        transfer = json.loads(option(argv, "--kv-transfer-config"))
        (tier,) = transfer["kv_connector_extra_config"]["secondary_tiers"]
        assert (spec.peer_host, spec.peer_port) == (tier["host"], tier["port"])
        assert spec.url == f"http://{tier['host']}:{option(argv, '--port')}"
        events = json.loads(option(argv, "--kv-events-config"))
        for endpoint, bound in ((spec.kv_events, events["endpoint"]),
                                (spec.kv_events_replay, events["replay_endpoint"])):  # fmt: skip
            assert endpoint == bound.replace("*", tier["host"])
        assert spec.sync_pulls  # KVPeerOffloadingConnector: the default for a kvpeer tier


def test_the_install_lines_are_the_scripts_steps() -> None:
    lines = commands("sh deploy/install.sh")
    assert [argv[argv.index("deploy/install.sh") + 1] for argv in lines] == ["wheel", "install"]
    assert all(argv[0].startswith("PYTHON=") for argv in lines)  # vLLM's environment
    assert lines[1][-1] == "requirements/nodeps.txt"
