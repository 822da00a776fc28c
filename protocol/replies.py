"""An admitted request's reply as one frame, whatever its task answered: a result msgpack
cannot carry becomes an ``internal`` error reply for that request alone."""

from __future__ import annotations

import logging
from typing import Any

from protocol.codec import encode_frame
from protocol.errors import InternalError, ServerError
from protocol.messages import error_reply, ok_reply

log = logging.getLogger(__name__)


def encoded_reply(request_id: int, result: dict[str, Any] | None,
                  error: ServerError | None) -> tuple[bytes, ServerError | None]:
    """The reply's frame, and its error: a result msgpack cannot carry (a plug-in's numpy
    scalar or set, a list for a map) is answered ``internal`` instead, for this request alone."""
    if error is None:
        try:
            return encode_frame(ok_reply(request_id, result or {})), None
        except (TypeError, ValueError, OverflowError) as exc:
            log.error("request %s: its result cannot be sent (%s: %s)", request_id,
                      type(exc).__name__, exc)
            error = InternalError(f"the result could not be encoded: {type(exc).__name__}")
    try:
        return encode_frame(error_reply(request_id, error)), error
    except (TypeError, ValueError, OverflowError):  # a plug-in's error with an odd message
        error = InternalError(f"the {error.code} error could not be encoded")
        return encode_frame(error_reply(request_id, error)), error
