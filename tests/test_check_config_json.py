"""``kvpeer check-config --json``: one object per file (tier JSON or router TOML): the
file, its kind, ok, and every problem as the lines name it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.test_checkconfig import transfer_config


def check(path: Path) -> tuple[int, dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "kvpeer", "check-config", "--json", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, json.loads(done.stdout)


def test_a_tier_config_with_problems_and_one_without(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(transfer_config(max_peers=0)))
    code, document = check(bad)
    assert code == 1
    assert document["file"] == str(bad)
    assert document["kind"] == "tier"
    assert document["ok"] is False
    assert any("secondary_tiers[1].max_peers" in p for p in document["problems"])
    good = tmp_path / "good.json"
    good.write_text(json.dumps(transfer_config()))
    code, document = check(good)
    assert code == 0
    effective = document.pop("effective")
    assert document == {"file": str(good), "kind": "tier", "ok": True, "problems": []}
    assert any("held blocks: a quarter of the CPU tier" in line for line in effective)
    assert any("pulling ahead: obeys prefetches from" in line for line in effective)


def test_a_router_toml(tmp_path: Path) -> None:
    router = tmp_path / "router.toml"
    router.write_text('mode = "shared"\nretries = 99\n[[engine]]\nname = "a"\n'
                      'url = "http://10.0.0.5:8100"\npeer = "10.0.0.5:5710"\n')
    code, document = check(router)
    assert code == 1
    assert document["kind"] == "router"
    assert document["ok"] is False
    assert any("retries" in p for p in document["problems"])
