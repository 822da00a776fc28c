"""One exception tree for everything that can go wrong with a request or a connection.

Each class carries the wire ``code`` that appears in an error reply. Errors whose ``fatal`` flag is
set end the connection after their reply (the byte stream can no longer be trusted); every other
error is scoped to the one request it names.
"""

from __future__ import annotations

from typing import ClassVar


class ServerError(Exception):
    """Base of every error that can be sent over the wire.

    Args:
        message: Human-readable explanation, sent as ``error.message``.
        request_id: The ``id`` of the request this error answers, when known.
    """

    code: ClassVar[str] = "internal"
    fatal: ClassVar[bool] = False

    def __init__(self, message: str, *, request_id: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class BadRequest(ServerError):
    """A request map that is missing a field, has a field of the wrong type, or an unknown op."""

    code = "bad_request"


class ProtocolError(ServerError):
    """The byte stream broke the framing rules; the connection is closed after the reply."""

    code = "protocol_error"
    fatal = True


class FrameTooLarge(ProtocolError):
    """A frame declared a length above the configured cap; refused before its body is read."""

    code = "frame_too_large"


class InternalError(ServerError):
    """A bug or unexpected failure inside the server while handling one request."""

    code = "internal"


class EngineError(ServerError):
    """The inference engine failed on the batch that held this request."""

    code = "engine_error"


class WorkerLost(ServerError):
    """The worker process holding this request died before answering it (it is restarted);
    the request may have run or not, and is safe to send again."""

    code = "worker_lost"


class Unavailable(ServerError):
    """The broker (Redis) cannot be reached, or no worker is serving: the request was refused
    at once, or its outcome is unknown (it may have run); safe to send again once the server
    says it is ready."""

    code = "unavailable"


class ShuttingDown(ServerError):
    """The server is draining and admits no new work."""

    code = "shutting_down"


class Overloaded(ServerError):
    """The shared queue is full: the request was refused at once, before any work was done."""

    code = "overloaded"


class DeadlineExceeded(ServerError):
    """The request's deadline passed while it waited in the queue; it was never run."""

    code = "deadline_exceeded"


class TooManyConnections(ServerError):
    """The server is at its connection cap; sent once on a new connection, which is then closed."""

    code = "too_many_connections"
    fatal = True


class IdleTimeout(ServerError):
    """The connection sent nothing and awaited nothing for too long; it is closed after this."""

    code = "idle_timeout"
    fatal = True


class FrameTimeout(ProtocolError):
    """A frame's bytes arrived too slowly (slowloris); the connection is closed after this."""

    code = "frame_timeout"


class Unauthorized(ServerError):
    """The connection has not authenticated: its first request was not an ``auth`` op with a
    token the server knows, a later ``auth`` had a wrong token, or no ``auth`` came within the
    server's auth timeout. Sent once, with a nil id; the connection is then closed."""

    code = "unauthorized"
    fatal = True


class UnknownServerError(ServerError):
    """An error reply whose code this version does not know (a newer server, say)."""

    def __init__(self, code: str, message: str, *, request_id: int | None = None) -> None:
        super().__init__(message, request_id=request_id)
        self.code = code  # type: ignore[misc]


ERRORS_BY_CODE: dict[str, type[ServerError]] = {
    cls.code: cls
    for cls in (BadRequest, ProtocolError, FrameTooLarge, InternalError, EngineError, WorkerLost,
                Unavailable, ShuttingDown, Overloaded, DeadlineExceeded, TooManyConnections,
                IdleTimeout, FrameTimeout, Unauthorized)
}


def error_for_code(code: str, message: str, *, request_id: int | None = None) -> ServerError:
    """Build the exception matching a wire ``code`` (used by clients to re-raise server errors)."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        return UnknownServerError(code, message, request_id=request_id)
    return cls(message, request_id=request_id)
