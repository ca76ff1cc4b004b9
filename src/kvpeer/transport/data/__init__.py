"""Data planes: the backend contract, per-peer negotiation, and the backends."""

from kvpeer.transport.data.base import Backend, PrimaryRegion, WriteWindow
from kvpeer.transport.data.planes import DataPlaneSet

__all__ = ["Backend", "DataPlaneSet", "PrimaryRegion", "WriteWindow"]
