"""``kvpeer stats`` pointed at a router says so and shows the router (not a node screen of
zeros with exit 0); ``--json`` prints every kvpeer sample of either kind."""

from __future__ import annotations

import asyncio
import json
import sys

from kvpeer.metrics.routerscreen import kind, samples
from tests.router.conftest import fleet, run


async def stats(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvpeer", "stats", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def test_stats_at_a_router_shows_the_router() -> None:
    async def scenario() -> None:
        async with fleet() as f:
            status, _ = await f.post("/v1/completions", {"model": "m", "prompt": [1, 2, 3],
                                                         "max_tokens": 2})
            assert status == 200
            await f.engines["b"].stop()
            await f.router.health.check_once(f.router.session)
            code, screen, err = await stats(f.url + "/metrics")
            assert code == 0, err
            assert screen.startswith(f"kvpeer router {f.url}/metrics")
            assert "engines           1 of 2 up" in screen
            assert "  b               DOWN" in screen
            assert "ok=1" in screen
            assert "kvpeer node" not in screen
            code, text, err = await stats("--json", f.url + "/metrics")
            assert code == 0, err
            document = json.loads(text)
            assert document["kind"] == "router"
            ups = {s["labels"]["engine"]: s["value"]
                   for s in document["metrics"]["kvpeer_router_engine_up"]}
            assert ups == {"a": 1.0, "b": 0.0}

    run(scenario(), timeout=120)


def test_a_page_without_kvpeer_metrics_is_told_apart() -> None:
    node = "# TYPE kvpeer_sessions gauge\nkvpeer_sessions 2\n"
    router = "# TYPE kvpeer_router_engines_healthy gauge\nkvpeer_router_engines_healthy 1\n"
    other = "# TYPE up gauge\nup 1\n"
    assert kind(samples(node)) == "node"
    assert kind(samples(router)) == "router"
    assert kind(samples(other)) is None
