"""Attacker-side tests reuse the real-network fixtures: subprocess nodes that are
always stopped, a ZMQ context, and the checks that no thread dies and no /dev/shm
file is left behind."""

from tests.net.conftest import (
    _no_shm_left,
    _no_thread_dies,
    processes,
    serve,
    zmq_context,
)

__all__ = ["_no_shm_left", "_no_thread_dies", "processes", "serve", "zmq_context"]
