"""Transports at the edge: control links and data planes (interfaces + implementations)."""

from kvpeer.transport.base import (
    ControlLink,
    ControlTransport,
    InboundFrame,
    LocalRegion,
    NodeDataPlane,
)

__all__ = ["ControlLink", "ControlTransport", "InboundFrame", "LocalRegion", "NodeDataPlane"]
