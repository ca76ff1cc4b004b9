"""Fixtures of the real-network tests: subprocess nodes that are always stopped,
a ZMQ context, and checks that no test leaks a thread exception or a /dev/shm file."""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.net.common import SHM_PREFIX, plane_params
from tests.net.processes import NodeProcess, StartNode, start_producer, start_serve


@pytest.fixture(autouse=True)
def _no_thread_dies() -> Iterator[None]:
    """An exception escaping any thread (a driver, a data plane) fails the test."""
    escaped: list[str] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        escaped.append(f"{name}: {args.exc_type.__name__}: {args.exc_value}")
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
    assert not escaped, f"exceptions escaped threads: {escaped}"


@pytest.fixture(autouse=True, scope="module")
def _no_shm_left() -> Iterator[None]:
    """Every /dev/shm file a test module created (in this process or in the
    processes it started) is gone when the module ends."""
    yield
    left = glob.glob(f"{SHM_PREFIX}{os.getpid()}-*")
    for path in left:
        os.unlink(path)
    assert not left, f"shared-memory files left behind: {left}"


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.fixture
def processes() -> Iterator[list[NodeProcess]]:
    """Node processes of one test; each is stopped (or killed) and cleaned up after it."""
    started: list[NodeProcess] = []
    try:
        yield started
    finally:
        for node in started:
            node.stop()


@pytest.fixture
def serve(tmp_path: Path, processes: list[NodeProcess]) -> StartNode:
    """``serve(**kwargs)``: a ``kvpeer serve`` subprocess (see ``processes.start_serve``)."""

    def start(**kwargs: Any) -> NodeProcess:
        wait = kwargs.pop("wait", True)
        node = start_serve(tmp_path, wait=False, **kwargs)
        processes.append(node)
        if wait:
            node.wait_ready()
        return node

    return start


@pytest.fixture
def producer(tmp_path: Path, processes: list[NodeProcess]) -> StartNode:
    """``producer(**kwargs)``: a PD producer subprocess (see ``processes.start_producer``)."""

    def start(**kwargs: Any) -> NodeProcess:
        wait = kwargs.pop("wait", True)
        node = start_producer(tmp_path, wait=False, **kwargs)
        processes.append(node)
        if wait:
            node.wait_ready()
        return node

    return start


@pytest.fixture(params=plane_params())
def plane(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name
