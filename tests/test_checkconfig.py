"""kvpeer check-config: every problem of a kv_transfer_config, named by its key path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvpeer.checkconfig import check_transfer_config, effective_settings


def transfer_config(**tier: object) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CpuTieringOffloadingSpec",
            "spec_module_path": "kvpeer.integrations.vllm.cpu_spec",
            "secondary_tiers": [
                {"type": "fs", "root_dir": "/tmp/x"},
                {"type": "KVPeerTier", "module_path": "kvpeer.integrations.vllm", **tier},
            ],
        },
    }


def test_a_good_config_has_no_problems() -> None:
    assert check_transfer_config(transfer_config(port="5710", load_timeout_s=20)) == []


def test_every_tier_problem_is_named_with_its_path() -> None:
    problems = check_transfer_config(
        transfer_config(load_timout_s=3, port=True, backpressure={"backpressure_cls": "X"})
    )
    where = "kv_connector_extra_config.secondary_tiers[1]"
    assert any(p.startswith(f"{where}.unknown key 'load_timout_s'") for p in problems)
    assert any("did you mean 'load_timeout_s'" in p for p in problems)
    assert any(p.startswith(f"{where}.port:") and "True" in p for p in problems)
    assert any(p.startswith(f"{where}.backpressure:") for p in problems)


def test_connector_spec_and_missing_tier_are_reported() -> None:
    config = transfer_config()
    config["kv_connector"] = "NixlConnector"
    config["kv_connector_extra_config"]["spec_name"] = "CPUOffloadingSpec"
    config["kv_connector_extra_config"]["secondary_tiers"] = [{"type": "fs"}]
    problems = check_transfer_config(config)
    assert [p.split(":")[0] for p in problems] == [
        "kv_connector",
        "kv_connector_extra_config.spec_name",
        "kv_connector_extra_config.secondary_tiers",
    ]


def test_a_single_tier_entry_is_checked_too() -> None:
    assert (
        check_transfer_config({"type": "KVPeerTier", "module_path": "kvpeer.integrations.vllm"})
        == []
    )
    problems = check_transfer_config({"type": "KVPeerTier", "host": ""})
    assert any(p.startswith("tier.module_path") for p in problems)
    assert any(p.startswith("tier.host") for p in problems)


def test_cli_prints_problems_and_exits_non_zero(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(transfer_config(max_peers=0)))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(transfer_config()))
    run = [sys.executable, "-m", "kvpeer", "check-config"]
    failed = subprocess.run([*run, str(bad)], capture_output=True, text=True, check=False)
    assert failed.returncode == 1
    assert "secondary_tiers[1].max_peers" in failed.stdout
    passed = subprocess.run([*run, str(good)], capture_output=True, text=True, check=False)
    assert passed.returncode == 0
    assert passed.stdout.splitlines()[0].endswith("good.json: ok")
    assert "held blocks: a quarter of the CPU tier" in passed.stdout
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    crashed = subprocess.run([*run, str(broken)], capture_output=True, text=True, check=False)
    assert crashed.returncode == 2
    assert "broken.json" in crashed.stderr


def kvpeer_connector_config(**extra: object) -> dict[str, Any]:
    config = transfer_config()
    config["kv_connector"] = "KVPeerOffloadingConnector"
    config["kv_connector_module_path"] = "kvpeer.integrations.vllm.connector"
    config["kv_connector_extra_config"].update(extra)
    return config


def test_kvpeers_connector_and_gpu_spec_are_accepted() -> None:
    assert check_transfer_config(kvpeer_connector_config()) == []
    gpu = kvpeer_connector_config(spec_name="KVPeerTieringOffloadingSpec", kvpeer_sync_load=False)
    assert check_transfer_config(gpu) == []


def test_kvpeers_connector_needs_its_module_and_a_boolean_sync_load() -> None:
    config = kvpeer_connector_config(kvpeer_sync_load="yes")
    del config["kv_connector_module_path"]
    config["kv_connector_extra_config"]["spec_module_path"] = "vllm.somewhere"
    problems = check_transfer_config(config)
    assert [p.split(":")[0] for p in problems] == [
        "kv_connector_module_path",
        "kv_connector_extra_config.spec_module_path",
        "kv_connector_extra_config.kvpeer_sync_load",
    ]
    assert "'yes'" in problems[-1]


def test_a_cpu_only_spec_is_refused_on_a_gpu_and_the_right_one_is_named() -> None:
    config = transfer_config(port=5710)
    assert check_transfer_config(config) == []
    assert check_transfer_config(config, device="cpu") == []
    (problem,) = check_transfer_config(config, device="cuda")
    assert problem.startswith("kv_connector_extra_config.spec_name: 'CpuTieringOffloadingSpec'")
    assert "'KVPeerTieringOffloadingSpec'" in problem
    config["kv_connector_extra_config"]["spec_name"] = "KVPeerTieringOffloadingSpec"
    assert check_transfer_config(config, device="cuda") == []


def test_check_config_shows_the_effective_sizes_of_the_defaults() -> None:
    """A tier entry with only host and port: held blocks sized from the CPU tier, and
    pulling ahead from the routers it trusts; keys that change either are reflected."""
    config = transfer_config(host="10.0.0.5", port=5710)
    config["kv_connector_extra_config"]["cpu_bytes_to_use"] = 8 << 30
    where = "kv_connector_extra_config.secondary_tiers[1]"
    assert effective_settings(config) == [
        f"{where}: held blocks: up to 2,048 MiB (a quarter of the CPU tier, at most "
        "4,096 MiB; cpu_bytes_to_use 8,192 MiB)",
        f"{where}: pulling ahead: obeys prefetches from 127.0.0.0/8, ::1/128 (by default), "
        "staging 256 rows of the CPU tier",
    ]
    config["kv_connector_extra_config"]["cpu_bytes_to_use"] = 64 << 30
    assert "up to 4,096 MiB" in effective_settings(config)[0]  # bounded
    fleet = transfer_config(allowed_peers=["10.0.0.0/16"], held_bytes=0, prefetch_from=[])
    assert effective_settings(fleet) == [
        f"{where}: held blocks: off (held_bytes 0)",
        f"{where}: pulling ahead: off (prefetch_from is [])",
    ]
    listed = transfer_config(allowed_peers=["10.0.0.0/16"], data_transports=["tcp"])
    assert effective_settings(listed) == [
        f"{where}: held blocks: none (only the shm data plane serves them)",
        f"{where}: pulling ahead: obeys prefetches from 10.0.0.0/16 (by default), staging "
        "256 rows of the CPU tier",
    ]
    assert effective_settings(transfer_config(max_peers=0)) == []  # refused: nothing said
