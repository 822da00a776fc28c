"""The blocking client: one pipelined connection, safe to share between threads (``Client``).

    from client import Client          # or: from clients.blocking import Client
    with Client("127.0.0.1", 9999) as c:       # token="...": a server with --auth_token_file
        print(c.models())                                 # what the server serves
        print(c.answer("Who went home?", "Bob went home."))
        futures = [c.submit(q, ctx) for q in questions]   # pipelined on one connection

A background reader thread matches replies to requests by ``id``; server errors are raised as
the typed exceptions of ``protocol.errors``. ``clients.aio.AsyncClient`` is the same for asyncio.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin from 3.11
from typing import Any

from clients.common import ConnectionLost, Result, shut
from clients.common import text_list as _text_list
from clients.endpoint import SendTimeout, describe, open_socket, send_by
from protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    FrameDecoder,
    ProtocolError,
    ServerError,
    auth_request,
    encode_frame,
    models_request,
    parse_reply,
    ping_request,
    stats_request,
)
from protocol.messages import model_request

__all__ = ["Client"]


class Client:
    """One connection to the server (TCP, TLS over TCP, or a Unix socket), safe to share
    between threads.

    Requests may be pipelined: ``submit`` sends at once and returns a Future; a background reader
    thread matches replies to futures by ``id``. Server errors are raised as the typed exceptions
    of ``protocol.errors`` (each carries the wire ``code``).

    Args:
        host: Server address, or ``unix:///path/to.sock`` for its Unix socket (``port`` is
            then ignored).
        port: Server port.
        connect_timeout: Seconds to wait for the connection (and the TLS handshake), and for
            the ``auth`` reply.
        max_frame_size: Largest reply frame accepted.
        tls: Connect over TLS (the server runs with ``--tls_cert``); the server's certificate
            must be signed by ``tls_ca`` and name ``host``.
        tls_ca: PEM file of the CA certificates to trust; None: the system's.
        tls_cert: PEM client certificate, for a server started with ``--tls_client_ca``.
        tls_key: Its private key, where not in ``tls_cert``'s file.
        token: Authenticate with this token (a server started with ``--auth_token_file``): the
            ``auth`` request is sent first and answered before the constructor returns. None:
            send none (a server that requires one closes the connection at the first request,
            which then fails with ``Unauthorized``).

    Raises:
        OSError: the server cannot be reached; ``ssl.SSLError`` when the TLS handshake fails.
        ValueError: TLS asked for a Unix socket, or TLS files given without ``tls=True``.
        Unauthorized: the server refused ``token``.
        ConnectionLost, TimeoutError: no answer to ``auth`` (within ``connect_timeout``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9999, *, connect_timeout: float = 10.0,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, token: str | None = None) -> None:
        self.address = (host, port)
        self._options: dict[str, Any] = {  # for reopen(); never printed
            "connect_timeout": connect_timeout, "max_frame_size": max_frame_size, "tls": tls,
            "tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key, "token": token}
        self._sock = open_socket(host, port, timeout=connect_timeout, tls=tls, tls_ca=tls_ca,
                                 tls_cert=tls_cert, tls_key=tls_key)
        self._decoder = FrameDecoder(max_frame_size)
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[Result]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed: BaseException | None = None
        self._reader = threading.Thread(target=self._read_loop, name="client-reader", daemon=True)
        self._reader.start()
        if token is not None:
            self._authenticate(token, connect_timeout)

    def _authenticate(self, token: str, timeout: float) -> None:
        """Send ``auth`` and wait for its answer; on refusal or silence, close and raise."""
        try:
            self.wait(self.request(lambda rid: auth_request(rid, token)), timeout)
        except BaseException:
            self.close()
            raise

    def reopen(self) -> Client:
        """A new connection to the same server with the same options (TLS and token too)."""
        return Client(*self.address, **self._options)

    @property
    def endpoint(self) -> str:
        """The server's address in words: ``HOST:PORT`` (and ``(TLS)``) or ``unix://PATH``."""
        return describe(*self.address, tls=self._options["tls"])

    # -- model requests ------------------------------------------------------------------------
    def submit_op(self, op: str, fields: Mapping[str, Any], *, timeout_ms: float | None = None,
                  model: str | None = None) -> Future[Result]:
        """Send a request of any model op now (``qa``, ``embed``, ``classify`` or a plug-in
        task's, whose fields the ``models`` op lists); the Future resolves to its result map.

        Args:
            op: The op.
            fields: The op's request fields (not ``id``, ``op``, ``timeout_ms`` or ``model``).
            timeout_ms: The request's deadline on the server, from admission: a request still
                queued then fails with ``DeadlineExceeded`` and is never run. None: the server's
                default (``--request_timeout_ms``).
            model: The served model to run it (``models()`` names them). None: the only model
                serving ``op``; where several do, the server answers ``BadRequest``.
        """
        return self.request(lambda rid: model_request(rid, op, fields, timeout_ms, model))

    def call(self, op: str, fields: Mapping[str, Any], *, model: str | None = None,
             timeout: float | None = None) -> Result:
        """``submit_op`` and wait for the result; with ``timeout`` (seconds) the server gets the
        same deadline, so it does not run a request nobody waits for any more.

        Raises:
            ServerError: a subclass matching the server's error code (e.g. BadRequest,
                Overloaded, DeadlineExceeded).
            ConnectionLost: the connection closed first.
            TimeoutError: no reply within ``timeout`` seconds.
        """
        timeout_ms = None if timeout is None else 1000 * timeout
        return self._ask(lambda rid: model_request(rid, op, fields, timeout_ms, model), timeout)

    def submit(self, question: str, context: str, *, timeout_ms: float | None = None,
               model: str | None = None) -> Future[Result]:
        """Send a ``qa`` request now; the Future resolves to ``{answer, score, start, end}``.
        ``timeout_ms`` and ``model`` as for ``submit_op``."""
        return self.submit_op("qa", {"question": question, "context": context},
                              timeout_ms=timeout_ms, model=model)

    def answer(self, question: str, context: str, timeout: float | None = None, *,
               model: str | None = None) -> Result:
        """Ask one question and wait for the answer ``{answer, score, start, end}``.

        Raises:
            As ``call``.
        """
        return self.call("qa", {"question": question, "context": context}, model=model,
                         timeout=timeout)

    def submit_embed(self, texts: Sequence[str], *, timeout_ms: float | None = None,
                     model: str | None = None) -> Future[Result]:
        """Send an ``embed`` request now; the Future resolves to the whole result map,
        ``{"embeddings": [[float, ...], ...], "dim": int}``, one vector per text, in order."""
        return self.submit_op("embed", {"texts": _text_list(texts)}, timeout_ms=timeout_ms,
                              model=model)

    def embed(self, texts: Sequence[str], model: str | None = None,
              timeout: float | None = None) -> list[list[float]]:
        """The embedding of each text, in order: L2-normalised vectors (so the dot product of
        two is their cosine similarity), all of the model's ``dim``. ``submit_embed`` gives the
        whole result map.

        Raises:
            TypeError: ``texts`` is one string, not a sequence of strings.
            As ``call``.
        """
        result = self.call("embed", {"texts": _text_list(texts)}, model=model, timeout=timeout)
        return result["embeddings"]

    def submit_classify(self, text: str, *, timeout_ms: float | None = None,
                        model: str | None = None) -> Future[Result]:
        """Send a ``classify`` request now; the Future resolves to ``{label, score, scores}``."""
        return self.submit_op("classify", {"text": text}, timeout_ms=timeout_ms, model=model)

    def classify(self, text: str, model: str | None = None,
                 timeout: float | None = None) -> Result:
        """The label of ``text``: ``{"label": str, "score": float, "scores": {label: prob}}``
        (``score`` is the label's probability; ``scores`` has every label's).

        Raises:
            As ``call``.
        """
        return self.call("classify", {"text": text}, model=model, timeout=timeout)

    # -- control requests ----------------------------------------------------------------------
    def models(self, timeout: float | None = None) -> list[Result]:
        """The models the server serves, each ``{name, task, op, inputs: {field: description},
        meaningful, ready}`` and ``warning`` where its outputs are not meaningful.

        Raises:
            BadRequest: a server older than the ``models`` op.
        """
        return self._ask(models_request, timeout)["models"]

    def ping(self, timeout: float | None = None) -> Result:
        """Round trip to the server; returns its ping result (``pong``, ``ready``)."""
        return self._ask(ping_request, timeout)

    def stats(self, timeout: float | None = None) -> Result:
        """The server's counters, timings and configuration (see docs/metrics.md)."""
        return self._ask(stats_request, timeout)

    def wait(self, future: Future[Result], timeout: float | None) -> Result:
        """``future.result(timeout)``; on timeout, stop tracking the request (no leak) and raise
        TimeoutError."""
        try:
            return future.result(timeout)
        except FutureTimeout:
            with self._lock:
                late = [rid for rid, f in self._pending.items() if f is future]
                for rid in late:
                    del self._pending[rid]  # a late reply is then ignored
            raise

    def _ask(self, build: Callable[[int], Result], timeout: float | None) -> Result:
        """Send a request and wait for its result, both within ``timeout`` seconds in all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        future = self.request(build, deadline)
        return self.wait(future, None if deadline is None else
                         max(0.0, deadline - time.monotonic()))

    def request(self, build: Callable[[int], Result],
                deadline: float | None = None) -> Future[Result]:
        """Send ``build(request_id)`` (a request map) and return the Future of its result.

        Args:
            build: Makes the request map for an id.
            deadline: A ``time.monotonic()`` by which the server must have taken the request
                (default: wait as long as it takes).

        Raises:
            ConnectionLost: the connection is closed.
            TimeoutError: the deadline passed while sending (a request cut off part-way also
                closes the connection: its other requests fail with ConnectionLost).
        """
        future: Future[Result] = Future()
        with self._lock:
            if self._closed is not None:
                raise ConnectionLost(f"connection to {self.endpoint} is closed") from self._closed
            request_id = next(self._ids)
            self._pending[request_id] = future
        frame = encode_frame(build(request_id))
        try:
            self._send(frame, deadline)
        except SendTimeout as exc:
            with self._lock:
                self._pending.pop(request_id, None)
            if not exc.clean:  # half a frame on the wire: this connection is done
                self._fail_all(ConnectionLost("a request was cut off by its timeout"))
                self._shut()
            raise
        except OSError as exc:
            self._fail_all(ConnectionLost(f"send failed: {exc}"))
        return future

    def _send(self, frame: bytes, deadline: float | None) -> None:
        """One frame, whole, one sender at a time (until ``deadline``, waiting for the others
        too)."""
        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._send_lock.acquire(timeout=wait):
            raise SendTimeout(clean=True)
        try:
            send_by(self._sock, frame, deadline)
        finally:
            self._send_lock.release()

    # -- replies ------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        error: BaseException = ConnectionLost("server closed the connection")
        try:
            while True:
                data = self._sock.recv(65536)
                self._decoder.receive_data(data)
                while (message := self._decoder.next_message()) is not None:
                    self._dispatch(message)
                if not data:
                    break
        except (OSError, ProtocolError) as exc:
            error = exc if isinstance(exc, ServerError) else ConnectionLost(str(exc))
        self._fail_all(error)

    def _dispatch(self, message: Any) -> None:
        reply = parse_reply(message)
        if reply.id is None:  # a connection-level error: it answers every pending request
            self._fail_all(reply.error or ConnectionLost("server reported an error"))
            return
        with self._lock:
            future = self._pending.pop(reply.id, None)
        if future is None:
            return  # a reply to nothing we are waiting for: ignore
        if reply.ok:
            future.set_result(reply.result or {})
        else:
            assert reply.error is not None
            future.set_exception(reply.error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = error
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Close the connection; pending requests fail with ConnectionLost."""
        self._shut()
        self._reader.join(timeout=5)
        self._fail_all(ConnectionLost("client closed"))

    def _shut(self) -> None:
        """Shut both directions (the reader thread wakes, the server sees the end) and close."""
        shut(self._sock)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
