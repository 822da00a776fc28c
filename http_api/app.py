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
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from dispatch.auth import Authenticator
from dispatch.handler import RequestHandler
from dispatch.models import ModelSet
from http_api.body import ClientGone, check_content_type, parse_json, read_body
from http_api.errors import HttpError
from http_api.exchange import Delivery, Exchange, Intake, Reply
from http_api.routing import Request, Response, Route, error_response
from http_api.shapes import Call
from protocol.errors import BadRequest, InternalError, ServerError, Unauthorized, Unavailable
from protocol.fields import MAX_TIMEOUT_MS, is_timeout
from settings.server_config import ServerConfig
from telemetry.stats import ServerStats

log = logging.getLogger("server.http")

#: The header that carries a request's deadline, in milliseconds, where its body has none.
TIMEOUT_HEADER = "x-timeout-ms"


class ServingState(Protocol):
    """What the HTTP API needs of the server it serves (server.InferenceServer)."""

    config: ServerConfig
    handler: RequestHandler
    models: ModelSet
    stats: ServerStats
    auth: Authenticator

    @property
    def serving(self) -> bool:
        """Started: every model loaded and the listeners accepting."""

    def collect_stats(self) -> tuple[dict[str, Any], ServerStats, dict[str, ServerStats]]: ...


RouteTable = Callable[["HttpApp"], tuple[dict[str, Route], list[tuple[str, str, Route]]]]
"""Makes an app's exact paths and patterns (``PREFIX{name}SUFFIX``), with their routes."""


class HttpApp:
    """The HTTP API's ASGI application.

    Args:
        state: The server served.
        intake: The threads that hand requests to dispatch/.
        routes: Makes the route table for this app (http_api/routes.py's ``route_table``).
    """

    def __init__(self, state: ServingState, intake: Intake, routes: RouteTable) -> None:
        self.state = state
        self.intake = intake
        self.limit = state.config.http_payload_limit
        self.delivery: Delivery | None = None  # made on the loop's first request
        self.exact, self.patterns = routes(self)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        try:
            response = await self._respond(scope, receive)
        except ClientGone:
            return
        try:
            body = _encoded(response.body)
        except (TypeError, ValueError) as exc:  # a plug-in's result JSON cannot carry
            log.error("HTTP %s: its reply cannot be sent as JSON (%s)", scope["path"], exc)
            response = self._refused(InternalError(f"the result could not be encoded as JSON: "
                                                   f"{type(exc).__name__}"))
            body = response.body
        await _send(send, response, body)

    async def _respond(self, scope: dict[str, Any], receive: Any) -> Response:
        path, method = scope["path"], scope["method"]
        route, params = self._match(path)
        if route is None:
            return self._refused(HttpError("not_found", f"no route {path[:100]!r} (see "
                                                        "GET /openapi.json)"),
                                 {"connection": "close"} if method != "GET" else None)
        handler = route.handlers.get(method)
        if handler is None:
            allowed = ", ".join(sorted(route.handlers))
            return self._refused(HttpError("method_not_allowed", f"{method} is not allowed on "
                                            f"{path}; allowed: {allowed}"),
                                 {"allow": allowed, "connection": "close"})
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        client = scope.get("client")
        request = Request(method, path, headers, params, receive,
                          f"{client[0]}:{client[1]}" if client else "?")
        try:
            if not route.open:
                self._authorize(headers)
            return await handler(request)
        except ServerError as exc:  # refused before any model: dispatch/ counted nothing
            return self._refused(exc, _unread(request))
        except ClientGone:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad request fails alone
            log.exception("HTTP %s %s failed", method, path)
            return self._refused(InternalError(f"{type(exc).__name__}: {exc}"),
                                 _unread(request))

    def _refused(self, error: ServerError, headers: dict[str, str] | None = None) -> Response:
        """The reply of an error of the HTTP layer, counted under op ``http`` in stats (an
        admitted request's error is counted by dispatch/, under its op)."""
        self.state.stats.count("http", error.code)
        return error_response(error, headers)

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
        """The request's JSON body, within the payload limit and ``--frame_timeout`` (counted
        from now: a pipelined request's head arrived while an earlier one was answered)."""
        check_content_type(request.headers)
        body = await read_body(request.receive, request.headers, self.limit, time.monotonic(),
                               self.state.config.frame_timeout_s)
        request.body_read = True
        return parse_json(body)

    def check_serving(self) -> None:
        """Raise ``unavailable`` until the server serves: while its models load, no model
        route can answer (and the model set may not be read yet)."""
        if not self.state.serving:
            raise Unavailable("the server is starting: its models are loading (GET "
                              "/health/ready says when it is ready)")

    async def run(self, request: Request, call: Call) -> Response:
        """Run ``call``'s wire requests through dispatch/ and answer with its reply's body, or
        the first request's error."""
        self.check_serving()
        timeout_ms = call.timeout_ms if call.timeout_ms is not None else \
            _header_timeout(request.headers)
        messages = [{**fields, "id": i, "op": call.op, "model": call.model,
                     "timeout_ms": timeout_ms} for i, fields in enumerate(call.requests)]
        if self.delivery is None:
            self.delivery = Delivery(asyncio.get_running_loop())
        exchange = Exchange(self.delivery, len(messages), request.peer)
        self.intake.put(exchange, messages)
        replies = await self._awaiting_client(request, exchange)
        for reply in replies:
            if reply.error is not None:  # dispatch/ counted it
                return error_response(reply.error)
        return Response(call.respond([reply.result or {} for reply in replies]))

    async def _awaiting_client(self, request: Request, exchange: Exchange) -> list[Reply]:
        """The exchange's replies. A client that disconnects first is answered nothing, and
        its queued requests are dropped (``Intake.client_gone``), as a TCP client's are."""
        watcher = asyncio.ensure_future(request.receive())

        def gone(_: Any) -> None:
            if not watcher.cancelled() and not exchange.future.done():
                self.intake.client_gone(exchange)
                exchange.future.cancel()

        watcher.add_done_callback(gone)
        try:
            return await exchange.future
        except asyncio.CancelledError:
            if exchange.is_open():  # this task was cancelled (a stop out of time)
                exchange.close()
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
    if not is_timeout(timeout):  # the wire's own check of timeout_ms
        raise BadRequest(f"header X-Timeout-Ms must be a positive number of milliseconds up "
                         f"to {MAX_TIMEOUT_MS}, got {value[:32]!r}")
    return timeout


def _unread(request: Request) -> dict[str, str] | None:
    """``Connection: close`` for a reply sent before the request's body was read whole: the
    rest of it is not read, so the connection cannot serve another request."""
    return None if request.method == "GET" or request.body_read else {"connection": "close"}


def _unauthorized() -> ServerError:
    return Unauthorized("a valid token is required: Authorization: Bearer TOKEN")


def _encoded(body: Any) -> bytes:
    """A reply's body as bytes: bytes as they are, anything else as JSON (numpy too)."""
    return body if isinstance(body, bytes) else \
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


async def _send(send: Any, response: Response, body: bytes) -> None:
    headers = [(b"content-type", response.content_type.encode("latin-1")),
               (b"content-length", str(len(body)).encode("ascii")),
               *((k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items())]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
