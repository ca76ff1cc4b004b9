"""``kvpeer stats``: the one-screen view of a live node's metrics."""

from __future__ import annotations

import subprocess
import sys

from kvpeer.metrics.prom import MetricsServer
from kvpeer.metrics.view import fetch, metrics_url, render
from tests.net.common import BLOCK_LEN, keys_of
from tests.net.localnode import LocalNode
from tests.net.servingnode import ServingNode


def test_the_view_of_a_node_that_pulled() -> None:
    with ServingNode("tcp") as producer, LocalNode("tcp") as consumer:
        assert consumer.pull(producer.peer_id, keys_of(range(4)), range(4)).loaded
        server = MetricsServer(consumer.node, "127.0.0.1", 0)
        try:
            target = f"127.0.0.1:{server.port}"
            screen = render(fetch(metrics_url(target)), target)
            done = subprocess.run(
                [sys.executable, "-m", "kvpeer", "stats", target],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        finally:
            server.close()
    assert "sessions          1 open; opened=1" in screen
    assert "fetches           ok 1, failed 0" in screen
    assert f"pulled            4 blocks, {4 * BLOCK_LEN // 1024:.1f} KiB" in screen
    assert "hit ratio 100.0%" in screen
    assert done.returncode == 0, done.stderr
    assert "fetches           ok 1" in done.stdout
    assert len(done.stdout.splitlines()) <= 24  # one screen


def test_vllm_names_and_engine_labels_are_summed() -> None:
    text = (
        "# TYPE vllm:kvpeer_fetches_total counter\n"
        'vllm:kvpeer_fetches_total{engine="0",model_name="m",result="ok"} 2\n'
        'vllm:kvpeer_fetches_total{engine="1",model_name="m",result="ok"} 3\n'
    )
    assert "fetches           ok 5, failed 0" in render(text)
    assert render("") == "no kvpeer metrics at that address"
