"""The listening socket and the ready file ``kvpeer router`` and the fake engine share."""

from __future__ import annotations

import socket
from pathlib import Path

__all__ = ["bind", "write_ready_file"]


def bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket; port 0 picks a free port, read back with ``getsockname``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def write_ready_file(path: Path, text: str) -> None:
    """Write atomically, so a poller never reads half a URL."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
