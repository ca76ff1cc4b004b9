"""``kvpeer soak`` runs its routers as ``kvpeer router`` processes
(kvpeer.lab.bench.routerproc): started from flags, ready when they listen, stopped by
their process group, and a router that cannot start says why."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from kvpeer.lab.bench.routerproc import RouterFailed, RouterProcess, engine_flag
from kvpeer.router.config import from_mapping, parse_engine_flag
from kvpeer.router.policy import EngineSpec, Mode, Role

ENGINE = EngineSpec(
    "a", "http://127.0.0.1:9", "127.0.0.1", 7, Role.BOTH,
    kv_events="tcp://127.0.0.1:11", kv_events_replay="tcp://127.0.0.1:12",
)  # fmt: skip


def test_the_engine_flag_is_read_back_as_the_same_engine() -> None:
    config = from_mapping({"mode": "shared"}, "test", [parse_engine_flag(engine_flag(ENGINE))])
    assert config.specs == (ENGINE,)
    prefill = EngineSpec("p", "http://127.0.0.1:8", "127.0.0.1", 6, Role.PREFILL)
    decode = EngineSpec("d", "http://127.0.0.1:9", "127.0.0.1", 7, Role.DECODE)
    flags = [parse_engine_flag(engine_flag(e)) for e in (prefill, decode)]
    assert from_mapping({"mode": "pd"}, "test", flags).specs == (prefill, decode)


def test_a_router_process_serves_metrics_and_its_group_is_gone_after_stop(
    tmp_path: Path,
) -> None:
    router = RouterProcess("shared", Mode.SHARED, [ENGINE], tmp_path, allow_pinning=True)
    with router:
        assert router.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(router.url + "/metrics", timeout=10) as answer:
            assert b"kvpeer_router_engine_up" in answer.read()
        pid = router.pid
        assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert not (tmp_path / "router-shared.ready").exists()


def test_a_router_that_cannot_start_says_why(tmp_path: Path) -> None:
    engine = EngineSpec("a", "not-a-url", "127.0.0.1", 7)
    router = RouterProcess("pd", Mode.SHARED, [engine], tmp_path)
    with pytest.raises(RouterFailed, match="router pd exited") as raised:
        router.start(timeout_s=60)
    assert "not-a-url" in str(raised.value)
