"""A ``kvpeer serve`` producer with a metrics port, for the metrics tests that scrape one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.net.common import free_port
from tests.net.processes import NodeProcess, start_serve

HEARTBEATS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}


@pytest.fixture
def producer(tmp_path: Path) -> Iterator[tuple[NodeProcess, int]]:
    """A producer node (fast heartbeats) and its metrics port."""
    port = free_port()
    node = start_serve(tmp_path, config=HEARTBEATS, args=["--metrics-port", str(port)])
    try:
        assert node.wait_for_output("metrics at"), node.log()
        yield node, port
    finally:
        node.stop()
