"""Typed errors as HTTP statuses: every error body is ``{"error": message, "error_type": code}``,
with the codes of docs/protocol.md, and ``Retry-After`` where retrying later is the remedy."""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from protocol.errors import ServerError

#: The status of each wire error code (docs/http.md's table).
STATUS_BY_CODE: dict[str, int] = {
    "bad_request": 422,  # valid JSON with wrong fields; malformed JSON is 400 (MalformedBody)
    "protocol_error": 400,
    "frame_too_large": 413,
    "frame_timeout": 408,
    "head_too_large": 431,
    "unauthorized": 401,
    "overloaded": 429,
    "too_many_connections": 429,
    "unavailable": 503,
    "shutting_down": 503,
    "deadline_exceeded": 504,
    "engine_error": 500,
    "worker_lost": 500,
    "internal": 500,
    "not_found": 404,
    "method_not_allowed": 405,
    "unsupported_media_type": 415,
}
#: Seconds a client is told to wait before it retries (``Retry-After``).
RETRY_AFTER_S = {"overloaded": 1, "too_many_connections": 1, "unavailable": 1,
                 "shutting_down": 5}


class HttpError(ServerError):
    """An error of the HTTP layer itself, with its own code and status (not found, wrong
    method, a body that is not JSON, the wrong content type)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # type: ignore[misc]


class MalformedBody(HttpError):
    """A body that is not one JSON value (400): unreadable UTF-8, bad or truncated JSON, or
    nested deeper than the parser takes."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_request", message)


def status_of(error: ServerError) -> int:
    """The HTTP status an error is answered with."""
    if isinstance(error, MalformedBody):
        return 400
    return STATUS_BY_CODE.get(error.code, 500)


def error_headers(error: ServerError) -> dict[str, str]:
    """The headers that go with an error's reply: ``Retry-After``, and ``WWW-Authenticate``
    for ``unauthorized``."""
    headers: dict[str, str] = {}
    if error.code in RETRY_AFTER_S:
        headers["retry-after"] = str(RETRY_AFTER_S[error.code])
    if error.code == "unauthorized":
        headers["www-authenticate"] = 'Bearer realm="qa-server"'
    return headers


def error_json(error: ServerError, extra: Mapping[str, object] | None = None) -> bytes:
    """The JSON body of an error reply."""
    return orjson.dumps({"error": error.message, "error_type": error.code, **(extra or {})})
