"""Token authentication (``--auth_token_file``): the server's tokens, each connection's state, and
what happens before a connection has authenticated.

With tokens configured, the first request of every connection must be ``auth`` with one of them.
Anything else first (any other op, a malformed frame's message, a wrong token), or nothing within
``--auth_timeout``, is answered ``unauthorized`` (a fatal reply, id nil) and the connection is
closed; nothing of it reaches a model. Without tokens, every connection starts authenticated and
``auth`` is answered ok whatever its token. Tokens never appear in a log line, a reply or the
statistics.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, Protocol

from protocol import error_reply, ok_reply, parse_request
from protocol.errors import BadRequest, ServerError, Unauthorized
from protocol.messages import AuthRequest, op_name
from settings.tokens import read_tokens
from telemetry.stats import ServerStats

log = logging.getLogger("server.auth")


def _digest(token: str) -> bytes:
    """A token as fixed-length bytes: comparing digests leaks no token's length."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenSet:
    """The tokens a server accepts, kept as SHA-256 digests and compared in constant time.

    Args:
        tokens: The accepted tokens (at least one).

    Raises:
        ValueError: no token.
    """

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = tuple(sorted({_digest(token) for token in tokens}))
        if not self._digests:
            raise ValueError("a token set needs at least one token")

    @classmethod
    def from_file(cls, path: str) -> TokenSet:
        """The tokens of a token file (settings/tokens.py).

        Raises:
            TokenFileError: unreadable, or no token in it.
        """
        return cls(read_tokens(path))

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"TokenSet({len(self)} tokens)"

    def matches(self, token: str) -> bool:
        """Whether ``token`` is one of the set. Compared with every token, each with
        ``hmac.compare_digest``, with no early exit: the time taken says nothing about which
        token matched, how much of one did, or how long any is."""
        candidate = _digest(token)
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(known, candidate)
        return found


class AuthState:
    """One connection's authentication: dispatch/'s per-connection state (``conn.state``)."""

    __slots__ = ("authenticated",)

    def __init__(self, authenticated: bool) -> None:
        self.authenticated = authenticated


class Guarded(Protocol):
    """What authentication needs of a connection (transport.Connection)."""

    peer: str
    state: Any

    def send(self, message: dict[str, Any], final: bool = False) -> bool:
        """Send one reply frame without blocking; ``final``: a fatal reply, then close."""

    def set_deadline(self, at: float | None,
                     expire: Callable[[], ServerError] | None = None) -> None:
        """Close with ``expire()``'s error unless cleared (None) before ``at``."""


class Authenticator:
    """The server's side of authentication.

    Args:
        tokens: The accepted tokens; None: no authentication (every connection is trusted).
        timeout_s: Seconds a connection has to authenticate (0: no limit of its own; the idle
            timeout still applies).
        stats: The server's statistics: ``auth`` outcomes, refusals, ``auth_failed`` and
            ``auth_timeout`` events.
    """

    def __init__(self, tokens: TokenSet | None, timeout_s: float, stats: ServerStats) -> None:
        self.tokens = tokens
        self.timeout_s = timeout_s
        self.stats = stats

    @property
    def required(self) -> bool:
        """Whether connections must authenticate."""
        return self.tokens is not None

    def connected(self, conn: Guarded) -> None:
        """A new connection: give it its state, and its deadline to authenticate."""
        conn.state = AuthState(authenticated=not self.required)
        if self.required and self.timeout_s > 0:
            conn.set_deadline(time.monotonic() + self.timeout_s, self._expired)

    def _expired(self) -> ServerError:
        """The error of a connection that did not authenticate in time (the transport sends
        it, logs it with the peer, and closes)."""
        self.stats.count_event("auth_timeout")
        return Unauthorized(f"not authenticated within {self.timeout_s:g} s (auth_timeout); "
                            "send 'auth' with a token first")

    def before_auth(self, message: Any, conn: Guarded, task_ops: Collection[str]) -> None:
        """A message on a connection that has not authenticated: an ``auth`` is checked, and
        anything else ends the connection, unparsed beyond its op."""
        op = op_name(message, task_ops)
        try:
            request = parse_request(message, task_ops) if op == AuthRequest.op else None
        except BadRequest as exc:
            self._refuse(conn, op, f"a malformed 'auth' request ({exc.message})")
            return
        if request is None:
            named = "" if op == "invalid" else f", not {op!r}"
            self._refuse(conn, op, f"not authenticated: the first request must be 'auth'{named}")
            return
        assert isinstance(request, AuthRequest)
        self.authenticate(request, conn)

    def authenticate(self, request: AuthRequest, conn: Guarded) -> None:
        """Answer an ``auth`` request: ok if the token is known (or no token is required),
        else ``unauthorized`` and close, whether or not the connection had authenticated."""
        if self.tokens is not None and not self.tokens.matches(request.token):
            self._refuse(conn, AuthRequest.op, "unknown token")
            return
        if not conn.state.authenticated:
            conn.state.authenticated = True
            conn.set_deadline(None)
            log.debug("connection %s: authenticated", conn.peer)
        self.stats.count(AuthRequest.op, "ok")
        conn.send(ok_reply(request.id, {"authenticated": True, "required": self.required}))

    def _refuse(self, conn: Guarded, op: str, why: str) -> None:
        """Count, log (the peer, never a token), answer ``unauthorized`` (id nil) and close."""
        log.warning("connection %s: refused, %s; closing", conn.peer, why)
        self.stats.count_event("auth_failed")
        self.stats.count(op, Unauthorized.code)
        conn.send(error_reply(None, Unauthorized(why)), final=True)
