"""The real-network fixtures of tests/net (subprocess nodes that are always stopped, a
ZMQ context, no thread exception and no /dev/shm file left behind), reused as they are."""

from __future__ import annotations

from tests.net.conftest import (
    _no_shm_left,
    _no_thread_dies,
    processes,
    serve,
    zmq_context,
)

__all__ = ["_no_shm_left", "_no_thread_dies", "processes", "serve", "zmq_context"]
