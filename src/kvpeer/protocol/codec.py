"""One codec per connection: typed messages to msgpack frames and back.

Decoding is bounded: the frame size is checked first, and every length in
the frame is checked against the limits in the message types before the
decoder allocates anything proportional to it. Any malformed input becomes
a :class:`~kvpeer.errors.ProtocolError` naming the offending field; a
well-formed map of an unknown ``type`` decodes to :class:`UnknownMessage`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Final, TypeAlias

import msgspec

from kvpeer.errors import ProtocolError
from kvpeer.protocol import limits
from kvpeer.protocol.messages import Message, UnknownMessage

__all__ = ["KNOWN_TYPES", "Codec", "Inbound", "Undecodable"]

KNOWN_TYPES: Final[frozenset[str]] = frozenset(
    str(cls.__struct_config__.tag) for cls in typing.get_args(Message)
)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A frame that is no valid message, as a value: what :meth:`Codec.decode` raised."""

    error: ProtocolError


#: One inbound frame, decoded once (:meth:`Codec.read`) and handed on as a value.
Inbound: TypeAlias = Message | UnknownMessage | Undecodable


class Codec:
    """Encodes :data:`Message` values and decodes frames into them."""

    def __init__(self, max_frame_bytes: int = limits.MAX_FRAME_BYTES) -> None:
        self._max_frame_bytes = max_frame_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
        self._envelope: msgspec.msgpack.Decoder[UnknownMessage] = msgspec.msgpack.Decoder(
            UnknownMessage
        )

    def encode(self, message: Message) -> bytes:
        """Return the msgpack frame for ``message``."""
        return self._encoder.encode(message)

    def decode(self, frame: bytes | bytearray | memoryview) -> Message | UnknownMessage:
        """Decode one frame; raise ProtocolError if it is not a valid message."""
        size = len(frame)
        if size > self._max_frame_bytes:
            raise ProtocolError(f"frame of {size} bytes exceeds {self._max_frame_bytes}")
        try:
            return self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            unknown = self._unknown_type(frame)
            if unknown is not None:
                return unknown
            raise ProtocolError(f"invalid message: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable frame: {exc}") from exc
        except RecursionError as exc:  # absurdly nested content
            raise ProtocolError("frame nested too deeply") from exc

    def read(self, frame: bytes | bytearray | memoryview) -> Inbound:
        """:meth:`decode`, with what it would raise returned as :class:`Undecodable`."""
        try:
            return self.decode(frame)
        except ProtocolError as exc:
            return Undecodable(exc)

    def _unknown_type(self, frame: bytes | bytearray | memoryview) -> UnknownMessage | None:
        """The frame as an UnknownMessage if its ``type`` is a string we do not know."""
        try:
            envelope = self._envelope.decode(frame)
        except (msgspec.MsgspecError, RecursionError):
            return None
        return None if envelope.type in KNOWN_TYPES else envelope
