"""The wire protocol: framing (:mod:`protocol.codec`), message shapes (:mod:`protocol.messages`)
and the error tree (:mod:`protocol.errors`). See ``docs/protocol.md`` for the specification."""

from protocol.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    HEADER_SIZE,
    MAX_WIRE_LENGTH,
    FrameDecoder,
    decode_body,
    encode_frame,
)
from protocol.errors import (
    ERRORS_BY_CODE,
    BadRequest,
    EngineError,
    FrameTooLarge,
    InternalError,
    ProtocolError,
    ServerError,
    ShuttingDown,
    UnknownServerError,
    error_for_code,
)
from protocol.messages import (
    REQUEST_PARSERS,
    PingRequest,
    QARequest,
    Reply,
    Request,
    StatsRequest,
    error_reply,
    ok_reply,
    parse_reply,
    parse_request,
    ping_request,
    qa_request,
    stats_request,
)

__all__ = [
    # errors
    "ERRORS_BY_CODE",
    "BadRequest",
    "EngineError",
    "FrameTooLarge",
    "InternalError",
    "ProtocolError",
    "ServerError",
    "ShuttingDown",
    "UnknownServerError",
    "error_for_code",
    # codec
    "DEFAULT_MAX_FRAME_SIZE",
    "HEADER_SIZE",
    "MAX_WIRE_LENGTH",
    "FrameDecoder",
    "decode_body",
    "encode_frame",
    # messages
    "REQUEST_PARSERS",
    "PingRequest",
    "QARequest",
    "Reply",
    "Request",
    "StatsRequest",
    "error_reply",
    "ok_reply",
    "parse_reply",
    "parse_request",
    "ping_request",
    "qa_request",
    "stats_request",
]
