"""The ASGI application: a table of routes, bearer tokens on every route but the probes, typed
errors as JSON, and the one way an HTTP request reaches the models (``HttpApp.run``): its wire
requests go to dispatch/ on an intake thread and are awaited, never run on the event loop.

Routes are matched by a dict of exact paths plus the few with a name in them; a request of
another method gets 405 with ``Allow``, an unknown path 404, both in the error shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from dispatch.auth import Authenticator
from dispatch.models import ModelSet
from http_api.body import ClientGone, check_content_type, parse_json, read_body
from http_api.errors import HttpError, error_headers, error_json, status_of
from http_api.exchange import Delivery, Exchange, Intake
from http_api.guard import BEGAN
from http_api.shapes import Call
from protocol.errors import BadRequest, InternalError, ServerError, Unavailable
from protocol.fields import MAX_TIMEOUT_MS
from settings.server_config import ServerConfig
from telemetry.stats import ServerStats

log = logging.getLogger("server.http")

#: The header that carries a request's deadline, in milliseconds, where its body has none.
TIMEOUT_HEADER = "x-timeout-ms"


class ServingState(Protocol):
    """What the HTTP API needs of the server it serves (server.InferenceServer)."""

    config: ServerConfig
    handler: Any  # dispatch.handler.RequestHandler
    models: ModelSet
    stats: ServerStats
    auth: Authenticator

    @property
    def ready(self) -> bool: ...

    @property
    def serving(self) -> bool: ...

    def collect_stats(self) -> tuple[dict[str, Any], ServerStats, dict[str, ServerStats]]: ...


@dataclass
class Request:
    """One HTTP request, as a route sees it."""

    method: str
    path: str
    headers: dict[str, str]
    params: dict[str, str]
    receive: Callable[[], Awaitable[dict[str, Any]]]
    began: float
    peer: str
    query: str = ""


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


class HttpApp:
    """The HTTP API's ASGI application.

    Args:
        state: The server served.
        intake: The threads that hand requests to dispatch/.
    """

    def __init__(self, state: ServingState, intake: Intake) -> None:
        from http_api.routes import route_table  # the routes use this module's types

        self.state = state
        self.intake = intake
        self.limit = state.config.http_payload_limit
        self.delivery: Delivery | None = None  # made on the loop's first request
        self.exact, self.patterns = route_table(self)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        try:
            response = await self._respond(scope, receive)
        except ClientGone:
            return
        await _send(send, response)

    async def _respond(self, scope: dict[str, Any], receive: Any) -> Response:
        path, method = scope["path"], scope["method"]
        route, params = self._match(path)
        if route is None:
            return error_response(HttpError("not_found", f"no route {path[:100]!r} (see "
                                                         "GET /openapi.json)"))
        handler = route.handlers.get(method)
        if handler is None:
            allowed = ", ".join(sorted(route.handlers))
            return error_response(HttpError("method_not_allowed", f"{method} is not allowed on "
                                             f"{path}; allowed: {allowed}"), {"allow": allowed})
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        client = scope.get("client")
        request = Request(method, path, headers, params, receive,
                          scope.get(BEGAN, time.monotonic()),
                          f"{client[0]}:{client[1]}" if client else "?",
                          scope.get("query_string", b"").decode("latin-1"))
        try:
            if not route.open:
                self._authorize(headers)
            return await handler(request)
        except ServerError as exc:
            return error_response(exc)
        except ClientGone:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad request fails alone
            log.exception("HTTP %s %s failed", method, path)
            return error_response(InternalError(f"{type(exc).__name__}: {exc}"))

    def _match(self, path: str) -> tuple[Route | None, dict[str, str]]:
        route = self.exact.get(path)
        if route is not None:
            return route, {}
        for prefix, suffix, pattern_route in self.patterns:
            if path.startswith(prefix) and path.endswith(suffix):
                name = path[len(prefix):len(path) - len(suffix)]
                if name and "/" not in name:
                    return pattern_route, {"name": name}
        return None, {}

    def _authorize(self, headers: dict[str, str]) -> None:
        tokens = self.state.auth.tokens
        if tokens is None:
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token or not tokens.matches(token.strip()):
            self.state.stats.count_event("auth_failed")
            raise _unauthorized()

    # -- the models ----------------------------------------------------------------------
    async def json_body(self, request: Request) -> Any:
        """The request's JSON body, within the payload limit and ``--frame_timeout``."""
        check_content_type(request.headers)
        body = await read_body(request.receive, request.headers, self.limit, request.began,
                               self.state.config.frame_timeout_s)
        return parse_json(body)

    async def run(self, request: Request, call: Call) -> Response:
        """Run ``call``'s wire requests through dispatch/ and answer with its reply's body, or
        the first request's error."""
        if not self.state.serving:
            raise Unavailable("the server is starting: its models are loading (GET "
                              "/health/ready says when it is ready)")
        timeout_ms = call.timeout_ms if call.timeout_ms is not None else \
            _header_timeout(request.headers)
        messages = [{**fields, "id": i, "op": call.op, "model": call.model,
                     "timeout_ms": timeout_ms} for i, fields in enumerate(call.requests)]
        if self.delivery is None:
            self.delivery = Delivery(asyncio.get_running_loop())
        exchange = Exchange(self.delivery, len(messages), request.peer)
        self.intake.put(exchange, messages)
        replies = await _awaiting_client(request, exchange)
        for reply in replies:
            if reply.error is not None:
                raise reply.error
        results = [reply.result or {} for reply in replies]
        return Response(call.respond(results), headers=call.headers)


async def _awaiting_client(request: Request, exchange: Exchange) -> list[Any]:
    """The exchange's replies; a client that disconnects first has its requests skipped
    (``exchange.close()``: queued work for it is not run) and is answered nothing."""
    watcher = asyncio.ensure_future(request.receive())

    def gone(_: Any) -> None:
        if not watcher.cancelled() and not exchange.future.done():
            exchange.close()
            exchange.future.cancel()

    watcher.add_done_callback(gone)
    try:
        return await exchange.future
    except asyncio.CancelledError:
        if exchange.is_open():
            raise
        raise ClientGone() from None
    finally:
        watcher.remove_done_callback(gone)
        watcher.cancel()


def _header_timeout(headers: dict[str, str]) -> float | None:
    value = headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        timeout = float(value)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout <= MAX_TIMEOUT_MS:
        raise BadRequest(f"header X-Timeout-Ms must be a positive number of milliseconds up "
                         f"to {MAX_TIMEOUT_MS}, got {value[:32]!r}")
    return timeout


def _unauthorized() -> ServerError:
    from protocol.errors import Unauthorized

    return Unauthorized("a valid token is required: Authorization: Bearer TOKEN")


def error_response(error: ServerError, headers: dict[str, str] | None = None) -> Response:
    """The reply of a typed error."""
    return Response(error_json(error), status_of(error), {**error_headers(error),
                                                          **(headers or {})})


async def _send(send: Any, response: Response) -> None:
    body = response.body if isinstance(response.body, bytes) else \
        orjson.dumps(response.body, option=orjson.OPT_SERIALIZE_NUMPY)
    headers = [(b"content-type", response.content_type.encode("latin-1")),
               (b"content-length", str(len(body)).encode("ascii")),
               *((k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items())]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
