"""Sans-IO framing: bytes in, decoded maps out, and maps back into bytes.

A frame is a 4-byte unsigned big-endian length ``N`` followed by ``N`` bytes of msgpack that encode
exactly one map. This module owns no sockets and no threads: the caller feeds whatever bytes it
received with :meth:`FrameDecoder.receive_data` (``b""`` meaning the peer closed) and pulls complete
messages with :meth:`FrameDecoder.next_message`, which returns ``None`` while a frame is incomplete.

Any framing error is fatal to the stream: once :meth:`FrameDecoder.next_message` has raised, the
decoder is broken and every later call raises :class:`~protocol.errors.ProtocolError` again.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import msgpack

from protocol.errors import FrameTooLarge, ProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "HEADER_SIZE",
    "MAX_WIRE_LENGTH",
    "FrameDecoder",
    "decode_body",
    "encode_frame",
]

DEFAULT_MAX_FRAME_SIZE: int = 1 << 20
"""Default cap on a frame's body length in bytes (1 MiB); the 4 header bytes are not counted."""

HEADER_SIZE: int = 4
"""Bytes in the length prefix that starts every frame."""

MAX_WIRE_LENGTH: int = 0xFFFF_FFFF
"""Largest body length the 4-byte header can express."""

_HEADER = struct.Struct(">I")


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """Encode one map as a complete frame: the length header followed by the msgpack body.

    Args:
        message: The map to send. Strings are packed as msgpack str, ``bytes`` as msgpack bin.

    Returns:
        The frame, ready to write to a socket.

    Raises:
        TypeError: ``message`` is not a mapping, or holds a value msgpack cannot pack.
        ValueError: the packed body is longer than the header can express.
    """
    if not isinstance(message, Mapping):
        raise TypeError(f"a frame must carry a map, not {type(message).__name__}")
    body = msgpack.packb(message if isinstance(message, dict) else dict(message), use_bin_type=True)
    if len(body) > MAX_WIRE_LENGTH:
        raise ValueError(f"message body of {len(body)} bytes does not fit a 4-byte length header")
    return _HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[Any, Any]:
    """Decode one frame body into its map.

    Args:
        body: Exactly the ``N`` bytes that followed a frame header.

    Returns:
        The decoded map (keys that are not strings are kept; validation ignores them).

    Raises:
        ProtocolError: the bytes are not one valid msgpack object, carry trailing bytes after it,
            or the object is not a map.
    """
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except msgpack.ExtraData as exc:
        extra = len(exc.extra)
        raise ProtocolError(f"frame has {extra} trailing byte(s) after its object") from None
    except (ValueError, TypeError) as exc:
        reason = str(exc) or type(exc).__name__  # some of msgpack's errors carry no message
        raise ProtocolError(f"frame body is not valid msgpack: {reason}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame must hold a msgpack map, not {type(obj).__name__}")
    return obj


class FrameDecoder:
    """Incremental decoder for a stream of length-prefixed msgpack frames.

    Args:
        max_frame_size: Largest body length accepted, in bytes. A header declaring more is refused
            with :class:`~protocol.errors.FrameTooLarge` before any of the body is read.

    Raises:
        ValueError: ``max_frame_size`` is below 1.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size < 1:
            raise ValueError(f"max_frame_size must be at least 1, got {max_frame_size}")
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()
        self._eof = False
        self._error: ProtocolError | None = None

    @property
    def closed(self) -> bool:
        """True once EOF was received and no complete or partial frame is left in the buffer."""
        return self._eof and not self._buffer

    @property
    def buffered(self) -> int:
        """Bytes held waiting for a frame to complete (or for :meth:`next_message` to take it)."""
        return len(self._buffer)

    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the peer.

        Args:
            data: The next bytes of the stream; ``b""`` means the peer closed its side (EOF).
                Bytes fed after the decoder broke are dropped.

        Raises:
            RuntimeError: non-empty data arrives after EOF was already fed.
        """
        if not data:
            self._eof = True
            return
        if self._eof:
            raise RuntimeError("received data after EOF")
        if self._error is None:
            self._buffer += data

    def next_message(self) -> dict[Any, Any] | None:
        """Take the next complete message out of the buffer.

        Returns:
            The decoded map, or ``None`` when more bytes are needed (or the stream ended cleanly
            between frames; see :attr:`closed`).

        Raises:
            FrameTooLarge: a header declares a body longer than ``max_frame_size``.
            ProtocolError: a zero length, a body that is not exactly one msgpack map, EOF in the
                middle of a frame, or any call after the decoder already raised.
        """
        if self._error is not None:
            raise ProtocolError(f"decoder is broken by an earlier error: {self._error.message}")
        try:
            return self._next_message()
        except ProtocolError as exc:
            self._error = exc
            self._buffer.clear()
            raise

    def _next_message(self) -> dict[Any, Any] | None:
        available = len(self._buffer)
        if available < HEADER_SIZE:
            if self._eof and available:
                raise ProtocolError(f"EOF inside a frame header ({available} of 4 bytes)")
            return None
        (length,) = _HEADER.unpack_from(self._buffer)
        if length > self.max_frame_size:
            limit = self.max_frame_size
            raise FrameTooLarge(f"frame declares {length} bytes; the limit is {limit}")
        if length == 0:
            raise ProtocolError("zero-length frame")
        end = HEADER_SIZE + length
        if available < end:
            if self._eof:
                got = available - HEADER_SIZE
                raise ProtocolError(f"EOF inside a frame body ({got} of {length} bytes)")
            return None
        body = bytes(self._buffer[HEADER_SIZE:end])
        del self._buffer[:end]
        return decode_body(body)
