"""The one exception tree of kvpeer.

Foreign exceptions (msgspec, zmq, nixl, OS errors) are translated into these
where they enter kvpeer, with ``raise ... from``.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DataPlaneError",
    "HandshakeRejected",
    "KVPeerError",
    "PeerLost",
    "ProtocolError",
]


class KVPeerError(Exception):
    """Base class of every error kvpeer raises on purpose."""


class ProtocolError(KVPeerError):
    """A peer sent something the protocol forbids (or we misused the API).

    Final for the session that saw it, never for the engine.
    """


class HandshakeRejected(KVPeerError):
    """A peer's ``connect`` failed a compatibility or policy check."""


class PeerLost(KVPeerError):
    """A peer went away: disconnect, timeout, restart or transport failure."""


class DataPlaneError(KVPeerError):
    """A data plane could not register a peer or start/complete a transfer."""


class ConfigError(KVPeerError, ValueError):
    """A configuration value is invalid; the message names the key and value."""
