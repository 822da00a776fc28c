"""Every decoded message of every connection goes through here: parse, route to a model, check
its limits, admit it, count it, and turn whatever goes wrong into its one reply.

A connection that has not authenticated (``--auth_token_file``) is dispatch/auth.py's until it
has: nothing it sends is parsed beyond its op, routed or admitted.

A request that runs a model gets a Completion (dispatch/completion.py) at admission, which answers
it exactly once and counts it once, in its model's statistics. Requests refused before that are
counted here: in their model's statistics once routed, else in the server's.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from dispatch.auth import Authenticator, Guarded
from dispatch.completion import Completion, Replier
from dispatch.models import ModelSet, ServedModel
from protocol import error_reply, ok_reply, parse_request
from protocol.errors import InternalError, ServerError, ShuttingDown
from protocol.limits import FieldLimits
from protocol.messages import AuthRequest, ModelRequest, Request, op_name
from telemetry.stats import ServerStats

log = logging.getLogger("server.requests")


class Sender(Replier, Guarded, Protocol):
    """The connection a message came on; ``state`` is its authentication (dispatch/auth.py)."""

    def is_open(self) -> bool:
        """False once the connection closed: its queued work is skipped."""

    def begin(self) -> None:
        """An admitted request is now owed a reply (or a release)."""


class ControlOps(Protocol):
    """What answers requests that run no model (the server: ping, stats, models)."""

    def control(self, request: Request) -> dict[str, Any]:
        """The result of ``request``, at once."""


class RequestHandler:
    """Turns decoded messages into admitted requests or replies.

    Args:
        models: The served models.
        limits: Caps on request fields.
        stats: The server's statistics (control ops, and refusals no model was found for).
        control: Answers ping, stats and models.
        request_timeout_ms: The default deadline of a request (0: none).
        auth: Authentication; default: none (every connection is trusted).
    """

    def __init__(self, models: ModelSet, limits: FieldLimits, stats: ServerStats,
                 control: ControlOps, request_timeout_ms: float,
                 auth: Authenticator | None = None) -> None:
        self.models = models
        self.limits = limits
        self.stats = stats
        self.control = control
        self.request_timeout_ms = request_timeout_ms
        self.auth = auth if auth is not None else Authenticator(None, 0.0, stats)
        self.draining = False

    def connected(self, conn: Sender) -> None:
        """A new connection, before its first read: its authentication state and deadline."""
        self.auth.connected(conn)

    def handle(self, message: Any, conn: Sender) -> None:
        """Answer or admit one decoded message; never raises."""
        ops = self.models.task_ops
        if not conn.state.authenticated:
            self.auth.before_auth(message, conn, ops)
            return
        op, request_id, counted = op_name(message, ops), None, self.stats
        try:
            request = parse_request(message, ops)
            request_id = request.id
            if isinstance(request, AuthRequest):
                self.auth.authenticate(request, conn)
                return
            if isinstance(request, ModelRequest):
                model = self.models.route(request)
                counted = model.stats
                self._admit(model, request, conn)
                return
            reply = ok_reply(request_id, self.control.control(request))
            self.stats.count(op, "ok")  # counted before sending, like every outcome
            conn.send(reply)
        except ServerError as exc:
            rid = exc.request_id if exc.request_id is not None else request_id
            counted.count(op, exc.code)
            conn.send(error_reply(rid, exc))
        except Exception as exc:  # noqa: BLE001 - one bad request fails alone
            log.exception("connection %s: unexpected error handling a request", conn.peer)
            counted.count(op, InternalError.code)
            conn.send(error_reply(request_id, InternalError(f"{type(exc).__name__}: {exc}")))

    def _admit(self, model: ServedModel, request: ModelRequest, conn: Sender) -> None:
        """Check and hand one request to its model's backend, or raise its ServerError."""
        if self.draining or model.backend is None:
            raise ShuttingDown("server is shutting down; request not admitted")
        self.limits.check(request)
        admitted = time.monotonic()
        timeout_ms = request.timeout_ms or self.request_timeout_ms
        completion = Completion(conn, request.id, model.stats, admitted)
        conn.begin()  # before admitting: the reply may come before submit returns
        model.stats.on_admitted()
        try:
            model.backend.submit(request, completion, conn.is_open, admitted,
                                 admitted + timeout_ms / 1000 if timeout_ms else None)
        except BaseException:
            model.stats.on_refused()  # counted and replied to as an error by handle()
            conn.release()
            raise

    def flush(self) -> None:
        """One read's requests were admitted: the backends may hand them on together."""
        self.models.flush()
