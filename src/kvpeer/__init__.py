"""kvpeer: a peer-to-peer KV-cache tier for LLM inference engines."""

from kvpeer.errors import (
    ConfigError,
    DataPlaneError,
    HandshakeRejected,
    KVPeerError,
    LocalFault,
    PeerLost,
    ProtocolError,
)
from kvpeer.types import Key, LookupResult, ServeRequest, StoreJob

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataPlaneError",
    "HandshakeRejected",
    "KVPeerError",
    "Key",
    "LocalFault",
    "LookupResult",
    "PeerLost",
    "ProtocolError",
    "ServeRequest",
    "StoreJob",
    "__version__",
]
