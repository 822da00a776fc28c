"""What a route is: the request it is handed, the response it gives, and its handlers by
method (http_api/app.py matches them, http_api/routes.py defines them)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from http_api.errors import error_headers, error_json, status_of
from protocol.errors import ServerError


@dataclass
class Request:
    """One HTTP request, as a route sees it (``body_read``: its body was read whole)."""

    method: str
    path: str
    headers: dict[str, str]
    params: dict[str, str]
    receive: Callable[[], Awaitable[dict[str, Any]]]
    peer: str
    body_read: bool = False


@dataclass
class Response:
    """A route's answer: a status, a body (bytes as they are; anything else as JSON), headers."""

    body: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    """A path's handlers by method; ``open``: served without a token (the probes)."""

    handlers: dict[str, Handler]
    open: bool = False


def error_response(error: ServerError, headers: dict[str, str] | None = None) -> Response:
    """The reply of a typed error."""
    return Response(error_json(error), status_of(error), {**error_headers(error),
                                                          **(headers or {})})
