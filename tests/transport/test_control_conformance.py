"""Every control transport against the one conformance suite
(kvpeer.testing.control_conformance): the in-memory network and ZMQ over loopback."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpeer.testing.control_conformance import (
    CHECKS,
    ControlNet,
    ControlNetFactory,
    MemoryNet,
    free_loopback_port,
)
from kvpeer.transport.base import ControlTransport
from kvpeer.transport.zmq_control import ZmqControl


class ZmqNet(ControlNet):
    def _make(self) -> ControlTransport:
        return ZmqControl("127.0.0.1", 0)

    def absent_peer_id(self) -> str:
        return f"127.0.0.1:{free_loopback_port()}"


FACTORIES: list[tuple[str, ControlNetFactory]] = [("memory", MemoryNet), ("zmq", ZmqNet)]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
@pytest.mark.parametrize("make", [f for _, f in FACTORIES], ids=[n for n, _ in FACTORIES])
def test_control_conformance(
    make: ControlNetFactory, check: Callable[[ControlNetFactory], None]
) -> None:
    check(make)
