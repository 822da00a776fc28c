"""The asyncio client: one pipelined connection, every request an awaitable (``AsyncClient``).

    import asyncio
    from client import AsyncClient

    async def main() -> None:
        async with AsyncClient("127.0.0.1", 9999) as c:
            print(await c.answer("Who went home?", "Bob went home.", timeout=5))
            futures = [c.submit(q, ctx) for q, ctx in pairs]   # all in flight at once
            answers = await asyncio.gather(*futures)

    asyncio.run(main())

The surface is the blocking ``clients.blocking.Client``'s, with ``await``: the same ops, the same
``timeout`` (sent to the server as the request's ``timeout_ms``), the same typed errors
(``protocol.errors``, from the reply's ``code``) and the same ``ConnectionLost``.

One reader task matches replies to requests by ``id``. Cancelling an await cancels its request
on this side only: the connection stays usable for every other request, and the reply that still
comes for it is dropped (counted in ``dropped_replies``). A frame is handed to the transport
whole, in one synchronous ``StreamWriter.write``, before anything can be cancelled, so a
cancellation (even while waiting in ``drain``) never leaves half a frame on the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from clients.common import ConnectionLost, Result, deadline_ms, text_list
from clients.endpoint import check_tls_options, client_context, unix_path
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

__all__ = ["AsyncClient"]

_READ_SIZE = 65536
#: Longest wait in ``close`` for the connection to end (a server that reads nothing).
CLOSE_WAIT_S = 5.0


class AsyncClient:
    """One TCP connection to the server, for one asyncio event loop.

    Open it with ``await AsyncClient.connect(host, port)`` or ``async with AsyncClient(host,
    port) as c``; use it only from the loop that opened it (it is not thread-safe: the blocking
    ``Client`` is). ``submit*`` send at once and return an ``asyncio.Future``; the coroutines
    (``answer``, ``embed``, ``call``, ...) send, wait for the socket to take the bytes (``drain``)
    and await the reply.

    Args:
        host: Server address.
        port: Server port.
        connect_timeout: Seconds to wait for the connection to open, and for the ``auth``
            reply.
        max_frame_size: Largest reply frame accepted.
        tls: Connect over TLS (the server runs with ``--tls_cert``): the server's
            certificate must be signed by ``tls_ca`` (None: the system's CAs) and name ``host``.
        tls_ca, tls_cert, tls_key: As ``Client``'s (a client certificate for a server started
            with ``--tls_client_ca``).
        token: Authenticate with this token (a server started with ``--auth_token_file``):
            ``open`` sends ``auth`` first and returns once it is accepted.

    ``host`` may be ``unix:///path/to.sock``, the server's Unix socket (``port`` is ignored).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9999, *,
                 connect_timeout: float = 10.0,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, token: str | None = None) -> None:
        check_tls_options(host, tls, tls_ca, tls_cert, tls_key)
        self.address = (host, port)
        self._tls = client_context(tls_ca, tls_cert, tls_key) if tls else None
        self._token = token  # never printed
        self.connect_timeout = connect_timeout
        self.dropped_replies = 0
        """Replies that arrived for no awaited request (cancelled or timed out), dropped."""
        self._decoder = FrameDecoder(max_frame_size)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Result]] = {}
        self._closed: BaseException | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._drain_lock = asyncio.Lock()  # binds to the running loop on first use (3.10+)

    # -- opening and closing -------------------------------------------------------------------
    @classmethod
    async def connect(cls, host: str = "127.0.0.1", port: int = 9999, *,
                      connect_timeout: float = 10.0,
                      max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, tls: bool = False,
                      tls_ca: str | None = None, tls_cert: str | None = None,
                      tls_key: str | None = None, token: str | None = None) -> AsyncClient:
        """Open a connection and return its client.

        Raises:
            OSError: the server cannot be reached (``ConnectionRefusedError``, ...).
            TimeoutError: it did not open (or answer ``auth``) within ``connect_timeout``.
            Unauthorized: the server refused ``token``.
        """
        client = cls(host, port, connect_timeout=connect_timeout, max_frame_size=max_frame_size,
                     tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token)
        await client.open()
        return client

    async def open(self) -> None:
        """Open the connection and start the reader task (``connect`` and ``async with`` call it).

        Raises:
            As ``connect``; RuntimeError when it was opened before.
        """
        if self._writer is not None or self._closed is not None:
            raise RuntimeError("an AsyncClient opens once; make a new one to reconnect")
        try:
            reader, writer = await asyncio.wait_for(self._open_streams(), self.connect_timeout)
        except asyncio.TimeoutError:  # distinct from the builtin before 3.11
            raise TimeoutError(f"connecting to {self.address} timed out") from None
        self._writer = writer
        self._reader_task = asyncio.get_running_loop().create_task(
            self._read_loop(reader), name=f"qa-client-reader-{self.address}")
        if self._token is not None:
            await self._authenticate(self._token)

    async def _authenticate(self, token: str) -> None:
        """Send ``auth`` and await its answer; on refusal or silence, close and raise."""
        try:
            await self.wait(self.request(lambda rid: auth_request(rid, token)),
                            self.connect_timeout)
        except BaseException:
            await self.close()
            raise

    async def _open_streams(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open the byte streams to ``self.address``: the one place the transport is chosen
        (TCP, TLS over TCP, or a ``unix://`` socket). asyncio sets ``TCP_NODELAY`` itself."""
        host, port = self.address
        path = unix_path(host)
        if path is not None:
            return await asyncio.open_unix_connection(path)
        return await asyncio.open_connection(host, port, ssl=self._tls,
                                             server_hostname=host if self._tls else None)

    async def close(self) -> None:
        """Close the connection; requests still pending fail with ConnectionLost."""
        self._fail_all(ConnectionLost("client closed"))
        if self._writer is not None:
            if self._writer.transport.get_write_buffer_size():
                self._writer.transport.abort()  # unsent requests, failed above: flush nothing
            else:
                self._writer.close()
            with contextlib.suppress(OSError, TimeoutError, asyncio.TimeoutError):  # 3.10
                await asyncio.wait_for(self._writer.wait_closed(), CLOSE_WAIT_S)
        if self._reader_task is not None:
            await asyncio.wait([self._reader_task], timeout=5)

    async def __aenter__(self) -> AsyncClient:
        if self._writer is None:
            await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- model requests ------------------------------------------------------------------------
    def submit_op(self, op: str, fields: Mapping[str, Any], *, timeout_ms: float | None = None,
                  model: str | None = None) -> asyncio.Future[Result]:
        """Send a request of any model op now (``qa``, ``embed``, ``classify`` or a plug-in
        task's); the Future resolves to its result map.

        Args:
            op: The op.
            fields: The op's request fields (not ``id``, ``op``, ``timeout_ms`` or ``model``).
            timeout_ms: The request's deadline on the server, from admission (None: the
                server's default, ``--request_timeout_ms``).
            model: The served model to run it (None: the only model serving ``op``).

        Raises:
            ConnectionLost: the connection is closed.
        """
        return self.request(lambda rid: model_request(rid, op, fields, timeout_ms, model))

    async def call(self, op: str, fields: Mapping[str, Any], *, model: str | None = None,
                   timeout: float | None = None) -> Result:
        """``submit_op`` and await the result; with ``timeout`` (seconds) the server gets the
        same deadline, so it does not run a request nobody waits for any more.

        Raises:
            ServerError: a subclass matching the server's error code (e.g. BadRequest,
                Overloaded, DeadlineExceeded).
            ConnectionLost: the connection closed first.
            TimeoutError: no reply within ``timeout`` seconds (the request is forgotten).
        """
        future = self.submit_op(op, fields, timeout_ms=deadline_ms(timeout), model=model)
        return await self.wait(future, timeout)

    def submit(self, question: str, context: str, *, timeout_ms: float | None = None,
               model: str | None = None) -> asyncio.Future[Result]:
        """Send a ``qa`` request now; the Future resolves to ``{answer, score, start, end}``."""
        return self.submit_op("qa", {"question": question, "context": context},
                              timeout_ms=timeout_ms, model=model)

    async def answer(self, question: str, context: str, timeout: float | None = None, *,
                     model: str | None = None) -> Result:
        """Ask one question and await the answer ``{answer, score, start, end}``.

        Raises:
            As ``call``.
        """
        return await self.call("qa", {"question": question, "context": context}, model=model,
                               timeout=timeout)

    def submit_embed(self, texts: Sequence[str], *, timeout_ms: float | None = None,
                     model: str | None = None) -> asyncio.Future[Result]:
        """Send an ``embed`` request now; the Future resolves to ``{"embeddings", "dim"}``."""
        return self.submit_op("embed", {"texts": text_list(texts)}, timeout_ms=timeout_ms,
                              model=model)

    async def embed(self, texts: Sequence[str], model: str | None = None,
                    timeout: float | None = None) -> list[list[float]]:
        """The L2-normalised embedding of each text, in order.

        Raises:
            TypeError: ``texts`` is one string, not a sequence of strings.
            As ``call``.
        """
        result = await self.call("embed", {"texts": text_list(texts)}, model=model,
                                 timeout=timeout)
        return result["embeddings"]

    def submit_classify(self, text: str, *, timeout_ms: float | None = None,
                        model: str | None = None) -> asyncio.Future[Result]:
        """Send a ``classify`` request now; the Future resolves to ``{label, score, scores}``."""
        return self.submit_op("classify", {"text": text}, timeout_ms=timeout_ms, model=model)

    async def classify(self, text: str, model: str | None = None,
                       timeout: float | None = None) -> Result:
        """The label of ``text``: ``{"label", "score", "scores": {label: probability}}``.

        Raises:
            As ``call``.
        """
        return await self.call("classify", {"text": text}, model=model, timeout=timeout)

    # -- control requests ----------------------------------------------------------------------
    async def models(self, timeout: float | None = None) -> list[Result]:
        """The models the server serves, each ``{name, task, op, inputs, meaningful, ready}``."""
        return (await self.wait(self.request(models_request), timeout))["models"]

    async def ping(self, timeout: float | None = None) -> Result:
        """Round trip to the server; returns its ping result (``pong``, ``ready``)."""
        return await self.wait(self.request(ping_request), timeout)

    async def stats(self, timeout: float | None = None) -> Result:
        """The server's counters, timings and configuration (see docs/metrics.md)."""
        return await self.wait(self.request(stats_request), timeout)

    # -- the machinery -------------------------------------------------------------------------
    async def wait(self, future: asyncio.Future[Result], timeout: float | None = None) -> Result:
        """Let the socket take what was sent (``drain``), then await ``future``'s result.

        On timeout or cancellation the request is cancelled here and forgotten: its reply, when
        it comes, is dropped.

        Raises:
            As ``call``.
        """
        try:
            return await asyncio.wait_for(self._settle(future), timeout)
        except asyncio.TimeoutError:  # distinct from the builtin before 3.11
            raise TimeoutError(f"no reply from {self.address} within {timeout} s") from None

    async def _settle(self, future: asyncio.Future[Result]) -> Result:
        try:
            await self.drain()
            return await future
        finally:
            if not future.done():  # cancelled while draining: forget the request too
                future.cancel()

    async def drain(self) -> None:
        """Wait while more than the transport's high-water mark is still unsent (backpressure
        for bursts of ``submit``). A broken connection is not raised here: the reader task
        fails every pending request with it."""
        if self._writer is None:
            return
        async with self._drain_lock:  # one drain waiter at a time (3.10's streams assert it)
            with contextlib.suppress(OSError):
                await self._writer.drain()

    def request(self, build: Callable[[int], Result]) -> asyncio.Future[Result]:
        """Send ``build(request_id)`` (a request map) now and return the Future of its result.

        The whole frame goes to the transport in one synchronous write: it is never torn.

        Raises:
            ConnectionLost: the connection is closed (or was never opened).
            TypeError: the request holds a value msgpack cannot pack (nothing is sent).
        """
        if self._closed is not None or self._writer is None:
            raise ConnectionLost(f"connection to {self.address} is "
                                 f"{'closed' if self._writer else 'not open'}") from self._closed
        request_id = next(self._ids)
        frame = encode_frame(build(request_id))
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        future.add_done_callback(lambda done: self._forget(request_id, done))
        self._writer.write(frame)
        return future

    def _forget(self, request_id: int, future: asyncio.Future[Result]) -> None:
        """A request's future is done: untrack it (a no-op unless it was cancelled)."""
        if self._pending.get(request_id) is future:
            del self._pending[request_id]

    # -- replies -------------------------------------------------------------------------------
    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        error: BaseException = ConnectionLost("server closed the connection")
        try:
            while True:
                data = await reader.read(_READ_SIZE)
                self._decoder.receive_data(data)
                while (message := self._decoder.next_message()) is not None:
                    self._dispatch(message)
                if not data:
                    break
        except (OSError, ProtocolError) as exc:
            error = exc if isinstance(exc, ServerError) else ConnectionLost(str(exc))
        except asyncio.CancelledError:
            error = ConnectionLost("the client's reader task was cancelled")
            raise
        finally:
            self._fail_all(error)
            if self._writer is not None:  # nothing more can be answered: release the socket
                self._writer.close()

    def _dispatch(self, message: Any) -> None:
        reply = parse_reply(message)
        if reply.id is None:  # a connection-level error: it answers every pending request
            self._fail_all(reply.error or ConnectionLost("server reported an error"))
            return
        future = self._pending.pop(reply.id, None)
        if future is None or future.done():  # cancelled or timed out: nobody waits for it
            self.dropped_replies += 1
        elif reply.ok:
            future.set_result(reply.result or {})
        else:
            assert reply.error is not None
            future.set_exception(reply.error)

    def _fail_all(self, error: BaseException) -> None:
        if self._closed is None:
            self._closed = error
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    @property
    def in_flight(self) -> int:
        """Requests sent and neither answered nor cancelled."""
        return len(self._pending)
