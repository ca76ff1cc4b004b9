"""The per-peer view: ``GET /peers`` next to ``/metrics``, and ``kvpeer stats``'s table."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from kvpeer.metrics import peers
from kvpeer.metrics.prom import MetricsServer
from kvpeer.metrics.view import peers_section
from tests.metrics.conftest import HEARTBEATS
from tests.net.common import keys_of
from tests.net.localnode import LocalNode
from tests.net.processes import NodeProcess


def get_peers(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/peers", timeout=10) as response:
        assert response.headers["Content-Type"] == "application/json"
        document: dict[str, Any] = json.loads(response.read())
    return document


def stats(target: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvpeer", "stats", target],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_producer_shows_the_consumers_session_and_stats_prints_it(
    producer: tuple[NodeProcess, int],
) -> None:
    serve, port = producer
    with LocalNode("tcp", config=HEARTBEATS) as consumer:
        server = MetricsServer(consumer.node, "127.0.0.1", 0)
        try:
            assert consumer.pull(serve.peer_id, keys_of(range(8)), range(8)).loaded
            theirs, mine = get_peers(port), get_peers(server.port)
            screen = stats(f"127.0.0.1:{port}")
        finally:
            server.close()
    assert theirs["node"] == serve.peer_id
    assert theirs["total"] == 1
    (seen,) = theirs["peers"]
    assert seen["peer_id"] == consumer.peer_id
    assert seen["state"] == "ready"
    assert seen["blocks_served"] == 8
    assert seen["blocks_pulled"] == 0
    assert seen["silent_s"] is not None
    assert 0 <= seen["silent_s"] <= seen["age_s"]
    assert seen["retry_in_s"] is None
    (pulled_from,) = mine["peers"]
    assert pulled_from["peer_id"] == serve.peer_id
    assert pulled_from["blocks_pulled"] == 8
    assert pulled_from["blocks_served"] == 0

    lines = screen.splitlines()
    assert "peers             1" in lines
    (row,) = [line for line in lines if line.startswith(consumer.peer_id)]
    assert row.split()[1] == "ready"
    assert row.split()[-1] == "8"
    assert len(lines) <= 24  # still one screen


def test_an_empty_node_has_no_peers() -> None:
    with LocalNode("tcp") as node:
        server = MetricsServer(node.node, "127.0.0.1", 0)
        try:
            document = get_peers(server.port)
            screen = stats(f"127.0.0.1:{server.port}")
        finally:
            server.close()
    assert document == {"format": peers.FORMAT, "node": node.peer_id, "total": 0, "peers": []}
    assert screen.splitlines()[-1] == "peers             none"


class _MetricsOnly(BaseHTTPRequestHandler):
    """Like vLLM's API server: ``/metrics`` with kvpeer's series, nothing at ``/peers``."""

    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        body = b'vllm:kvpeer_sessions{engine="0",model_name="m"} 1\n'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_stats_says_so_when_the_address_has_no_peer_view() -> None:
    server = HTTPServer(("127.0.0.1", 0), _MetricsOnly)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        section = peers_section(url)
        screen = stats(url)
    finally:
        server.shutdown()
        server.server_close()
    assert "no per-peer view here" in section
    assert "HTTP 404" in section
    assert "sessions          1 open" in screen
    assert "no per-peer view here" in screen


def test_peer_ids_from_the_network_never_reach_the_terminal_raw() -> None:
    hostile = "10.0.0.1:5\x1b[2J\x07\nforged line\u202e" + "x" * 100
    document = {
        "format": peers.FORMAT,
        "total": 12,
        "peers": [
            {"peer_id": hostile, "state": "ready\r", "age_s": 3.0, "silent_s": None}
            for _ in range(12)
        ],
    }
    table = peers.render(document)
    assert all(" " <= c <= "~" for line in table.splitlines() for c in line)
    assert "forged line" not in table.splitlines()[2][:10]
    assert len(table.splitlines()) == 2 + peers.SHOWN + 1
    assert table.splitlines()[-1] == "... and 4 more (GET /peers for all)"
    assert max(len(line) for line in table.splitlines()) <= 100
