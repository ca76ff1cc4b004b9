"""Wire protocol: typed messages, limits and the codec. Sans-IO."""

from kvpeer.protocol.codec import KNOWN_TYPES, Codec
from kvpeer.protocol.messages import (
    PROTOCOL_VERSION,
    AbortAck,
    AbortFetch,
    AckExtension,
    Connect,
    ConnectAck,
    ConnectExtension,
    Disconnect,
    Fetch,
    Key,
    Lookup,
    LookupResponse,
    Message,
    TransferDone,
    TransportChoice,
    TransportOffer,
    UnknownMessage,
)

__all__ = [
    "KNOWN_TYPES",
    "PROTOCOL_VERSION",
    "AbortAck",
    "AbortFetch",
    "AckExtension",
    "Codec",
    "Connect",
    "ConnectAck",
    "ConnectExtension",
    "Disconnect",
    "Fetch",
    "Key",
    "Lookup",
    "LookupResponse",
    "Message",
    "TransferDone",
    "TransportChoice",
    "TransportOffer",
    "UnknownMessage",
]
