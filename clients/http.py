"""A blocking client of the HTTP API's native route, ``POST /ops/{op}`` (docs/http.md), with
the interface of ``clients.blocking.Client`` that the load generator uses (bench/loadgen.py).

    from clients.http import HttpClient
    with HttpClient("http://127.0.0.1:8000", token=None) as c:
        print(c.submit("Who went home?", "Bob went home.").result())
        print(c.submit_op("embed", {"texts": ["a", "b"]}).result()["dim"])

One keep-alive HTTP/1.1 connection per client, framed by h11 (sans-IO). HTTP/1.1 has no reply
ids, and h11 does not pipeline, so **one request is on the wire at a time**: requests submitted
meanwhile wait in a queue and go out in order, each as soon as the previous response is in. A
reader thread parses the responses and completes the futures, so a done-callback may submit the
next request (it is then sent from that thread). A 200's JSON body is the op's result map; an
error's ``{"error", "error_type"}`` is raised as the typed ``ServerError`` of
``protocol.errors``; a connection that breaks or closes fails what is left with
``ConnectionLost``.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlsplit

import h11

from clients.common import ConnectionLost, Result, shut
from clients.endpoint import ByteStream, open_socket
from protocol.errors import ServerError, error_for_code

__all__ = ["HttpClient"]

#: The error code of an error response whose body is not the API's JSON error.
_CODE_BY_STATUS = {400: "bad_request", 401: "unauthorized", 404: "not_found",
                   408: "frame_timeout", 413: "frame_too_large", 422: "bad_request",
                   429: "overloaded", 503: "unavailable", 504: "deadline_exceeded"}
#: A queued request: method, path (after the URL's own path), JSON body, its future.
_Queued = tuple[str, str, bytes, Future[Result]]


class HttpClient:
    """One keep-alive HTTP/1.1 (or HTTPS) connection to the server's HTTP API, safe to share
    between threads; requests go one at a time, in the order submitted.

    Args:
        url: ``http://HOST:PORT`` or ``https://HOST:PORT``, optionally with a path the API's
            routes hang under (the port defaults to 80 or 443, as in any URL).
        token: Sent as ``Authorization: Bearer TOKEN`` (a server with ``--auth_token_file``);
            a refused one fails each request with ``Unauthorized``.
        tls_ca: PEM CA certificates to trust for ``https`` (None: the system's).
        tls_cert: PEM client certificate, for a server with ``--tls_client_ca``.
        tls_key: Its private key, where not in ``tls_cert``'s file.
        timeout: Seconds to connect, TLS handshake included.

    Raises:
        ValueError: not an http(s) URL, or TLS files with an ``http://`` one.
        OSError: the server cannot be reached (``ssl.SSLError``: the handshake failed).
    """

    def __init__(self, url: str, *, token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 timeout: float = 10.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// or https:// URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)  # .port: ValueError for a bad one
        self.url = url
        self._base = parts.path.rstrip("/")
        self._headers = [("host", parts.netloc.rpartition("@")[2]),
                         ("accept", "application/json"), ("user-agent", "qa-stress")]
        if token is not None:
            self._headers.append(("authorization", f"Bearer {token}"))
        self._sock: ByteStream = open_socket(parts.hostname, port, timeout=timeout, tls=tls,
                                             tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._conn = h11.Connection(h11.CLIENT)
        self._lock = threading.Lock()  # the h11 state, the queue and the request in flight
        self._send_lock = threading.Lock()  # one writer at a time
        self._queue: deque[_Queued] = deque()
        self._current: Future[Result] | None = None
        self._status = 0
        self._body = bytearray()
        self._closed: BaseException | None = None
        self._reader = threading.Thread(target=self._read_loop, name="http-client-reader",
                                        daemon=True)
        self._reader.start()

    # -- requests ----------------------------------------------------------------------------
    def submit_op(self, op: str, fields: Mapping[str, Any], *, timeout_ms: float | None = None,
                  model: str | None = None) -> Future[Result]:
        """Queue ``POST /ops/{op}`` with ``fields`` (and ``timeout_ms``, ``model`` where given)
        as its JSON body; the Future resolves to the op's result map, as over TCP.

        Raises:
            ConnectionLost: the connection is closed.
        """
        body = dict(fields)
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        if model is not None:
            body["model"] = model
        return self.request("POST", f"/ops/{op}", body)

    def submit(self, question: str, context: str, *, timeout_ms: float | None = None,
               model: str | None = None) -> Future[Result]:
        """Queue a ``qa`` request; the Future resolves to ``{answer, score, start, end}``."""
        return self.submit_op("qa", {"question": question, "context": context},
                              timeout_ms=timeout_ms, model=model)

    def models(self, timeout: float | None = None) -> list[Result]:
        """The models served (``GET /info``'s ``models``, as the TCP ``models`` op lists them).

        Raises:
            ServerError: e.g. ``Unauthorized`` for a missing or refused token.
            ConnectionLost, TimeoutError: no answer (within ``timeout`` seconds).
        """
        return self.request("GET", "/info").result(timeout)["models"]

    def request(self, method: str, path: str,
                body: Mapping[str, Any] | None = None) -> Future[Result]:
        """Queue ``method path`` (under the URL's path) with ``body`` as JSON; the Future
        resolves to the response's JSON object, or fails with its typed error.

        Raises:
            ConnectionLost: the connection is closed.
        """
        future: Future[Result] = Future()
        payload = b"" if body is None else json.dumps(body).encode("utf-8")
        with self._lock:
            if self._closed is not None:
                raise ConnectionLost(f"connection to {self.url} is closed") from self._closed
            self._queue.append((method, self._base + path, payload, future))
            data = self._next_request()
        self._write(data)
        return future

    def _next_request(self) -> bytes:
        """(Lock held.) The bytes of the next queued request if the connection is idle (it is
        then in flight), else b"". A request cancelled while queued is never sent."""
        if self._current is not None or self._closed is not None \
                or self._conn.our_state is not h11.IDLE:
            return b""
        while self._queue:
            method, target, payload, future = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                break
        else:
            return b""
        self._current = future
        headers = [*self._headers, ("content-length", str(len(payload)))]
        if payload:
            headers.append(("content-type", "application/json"))
        events = [h11.Request(method=method, target=target, headers=headers),
                  *([h11.Data(data=payload)] if payload else []), h11.EndOfMessage()]
        return b"".join(self._conn.send(event) or b"" for event in events)

    def _write(self, data: bytes) -> None:
        """Send one request's bytes; a broken connection fails every request left."""
        if not data:
            return
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as exc:
            self._fail(ConnectionLost(f"send failed: {exc}"))
            self._shut()

    # -- responses ---------------------------------------------------------------------------
    def _read_loop(self) -> None:
        error: BaseException = ConnectionLost("the server closed the connection")
        try:
            while True:
                data = self._sock.recv(65536)
                with self._lock:
                    self._conn.receive_data(data)
                    done = self._response()
                if done is not None:
                    future, outcome = done
                    if isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)  # callbacks run here, and may submit
                    with self._lock:
                        next_data = self._next_request()
                    self._write(next_data)
                    if self._closed is not None:  # the server said it closes: no more
                        break
                if not data:
                    break
        except (OSError, h11.ProtocolError, ConnectionLost) as exc:
            error = exc if isinstance(exc, ConnectionLost) else ConnectionLost(str(exc))
        self._fail(error)

    def _response(self) -> tuple[Future[Result], Result | ServerError] | None:
        """(Lock held.) Parse what has arrived; the request in flight and its outcome once its
        response is complete, else None."""
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return None
            if isinstance(event, h11.Response):
                self._status = event.status_code
                self._body.clear()
            elif isinstance(event, h11.Data):
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage):
                future, self._current = self._current, None
                if future is None:
                    raise ConnectionLost("a response to no request")
                if self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE:
                    self._conn.start_next_cycle()
                else:  # Connection: close, or an HTTP/1.0 server
                    self._closed = ConnectionLost("the server closed the connection")
                return future, _outcome(self._status, bytes(self._body))
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionLost("the server closed the connection")

    def _fail(self, error: BaseException) -> None:
        """Mark the connection closed and fail the request in flight and every queued one."""
        with self._lock:
            if self._closed is None:
                self._closed = error
            waiting = [queued[3] for queued in self._queue]
            if self._current is not None:
                waiting.insert(0, self._current)
            self._queue.clear()
            self._current = None
        for future in waiting:
            if not future.done():
                future.set_exception(error)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection; requests not yet answered fail with ConnectionLost."""
        self._shut()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)
        self._fail(ConnectionLost("client closed"))

    def _shut(self) -> None:
        """Shut both directions (the reader thread wakes, the server sees the end) and close."""
        shut(self._sock)

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _outcome(status: int, body: bytes) -> Result | ServerError:
    """A response's result map (a 2xx with a JSON object) or its typed error."""
    try:
        document = json.loads(body) if body else None
    except ValueError:
        document = None
    if 200 <= status < 300 and isinstance(document, dict):
        return document
    if isinstance(document, dict) and isinstance(document.get("error_type"), str):
        return error_for_code(document["error_type"], str(document.get("error", "")))
    text = body[:200].decode("utf-8", "replace")
    return error_for_code(_CODE_BY_STATUS.get(status, "internal"),
                          f"HTTP {status}: {text or 'no body'}")
