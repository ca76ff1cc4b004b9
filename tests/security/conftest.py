"""Fixtures of the attacker-side tests: those of the real-network tests, imported."""

from __future__ import annotations

from tests.net.conftest import (
    _no_shm_left,
    _no_thread_dies,
    processes,
    serve,
    zmq_context,
)

__all__ = ["_no_shm_left", "_no_thread_dies", "processes", "serve", "zmq_context"]
