"""One HTTP request's wire requests, handed to dispatch/ off the event loop and awaited on it.

An ``Exchange`` is what dispatch/ answers an HTTP request's requests on: the connection of
``dispatch.handler.Sender`` (and the ``Replier`` of each admitted request's Completion). The
event loop never runs dispatch/ itself, which may tokenize: an ``Intake`` thread takes each
exchange's requests and hands them to the handler, as a TCP connection's reader does, then
flushes once for everything it took at once. Replies come back from whichever thread finished
each request (a session, the deadline reaper, a worker's pipe, the broker's reader) and are
delivered to the loop with one wake-up per batch where a session answers several (coalesced
like TCP's writes, transport/coalesce.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import orjson

from dispatch.auth import AuthState
from protocol.errors import InternalError, ServerError, error_for_code
from transport.coalesce import holding

log = logging.getLogger("server.http")

#: Most exchanges an intake thread hands on before it flushes the backends.
INTAKE_BURST = 64


class Reply(NamedTuple):
    """One wire request's outcome: its result, or its typed error."""

    result: dict[str, Any] | None
    error: ServerError | None


class Dispatcher(Protocol):
    """What an exchange's requests are handed to (dispatch.handler.RequestHandler)."""

    def handle(self, message: Any, conn: Any) -> None: ...

    def flush(self) -> None: ...


class Delivery:
    """Hands finished exchanges to the event loop: at once, or, inside a thread's
    ``coalesced_sends()``, all of a batch's with one wake-up of the loop when it ends."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._held: list[Exchange] = []
        self._lock = threading.Lock()

    def deliver(self, exchange: Exchange) -> None:
        """``exchange`` has every reply: wake its awaiting route (any thread)."""
        if holding(self):
            with self._lock:
                self._held.append(exchange)
            return
        self._call(_resolve, exchange)

    def flush_held(self) -> None:
        """Deliver what this thread's ``coalesced_sends()`` held (transport/coalesce.py)."""
        with self._lock:
            held, self._held = self._held, []
        if held:
            self._call(_resolve_all, held)

    def _call(self, callback: Callable[..., None], arg: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(callback, arg)
        except RuntimeError:  # the loop has closed: nobody awaits the reply any more
            pass


def _resolve(exchange: Exchange) -> None:
    if not exchange.future.done():
        exchange.future.set_result(exchange.replies())


def _resolve_all(exchanges: Sequence[Exchange]) -> None:
    for exchange in exchanges:
        _resolve(exchange)


class Exchange:
    """One HTTP request's wire requests, numbered 0..n-1, and their replies.

    Args:
        delivery: Where the finished exchange goes (the event loop).
        count: How many wire requests it holds.
        peer: The client, for the log.
    """

    def __init__(self, delivery: Delivery, count: int, peer: str) -> None:
        self.peer = peer
        self.state = AuthState(authenticated=True)  # the route checked the bearer token
        self.future: asyncio.Future[list[Reply]] = delivery.loop.create_future()
        self._delivery = delivery
        self._count = count
        self._replies: dict[int, Reply] = {}
        self._lock = threading.Lock()
        self._open = True

    def replies(self) -> list[Reply]:
        """Every reply, in request order."""
        return [self._replies[i] for i in range(self._count)]

    # -- what dispatch/ calls (dispatch.handler.Sender, dispatch.completion.Replier) ---------
    def is_open(self) -> bool:
        """False once the HTTP client has gone: its queued work is skipped."""
        return self._open

    def close(self) -> None:
        """The HTTP client disconnected before its reply."""
        self._open = False

    def begin(self) -> None:
        """An admitted request is now owed a reply (nothing to count here)."""

    def release(self) -> None:
        """An admitted request will get no reply from its Completion: its client left, or it
        was refused after all (then answered through ``send``)."""

    def set_deadline(self, at: float | None, expire: Any = None) -> None:
        """Connections' auth deadlines do not apply: HTTP authenticates each request."""

    @staticmethod
    def encode_reply(request_id: int, result: dict[str, Any] | None,
                     error: ServerError | None) -> tuple[Any, ServerError | None]:
        """The reply as it is (the route shapes and encodes it on the loop), or ``internal``
        where JSON cannot carry its result (a plug-in's set, say), for this request alone."""
        if error is None:
            try:
                orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY)
            except (TypeError, ValueError) as exc:
                log.error("request %s: its result cannot be sent as JSON (%s)", request_id, exc)
                error = InternalError(f"the result could not be encoded: {type(exc).__name__}")
                result = None
        return (request_id, Reply(result, error)), error

    def send_reply(self, reply: tuple[int, Reply]) -> None:
        """An admitted request's reply (any thread)."""
        self._record(*reply)

    def send(self, message: dict[str, Any], final: bool = False) -> bool:
        """A reply dispatch/ made at once: a refusal or a control op's result (wire map).
        One it cannot match to a request answers every unanswered request of the exchange
        with its error, so that none waits for a reply that will not come."""
        if message.get("ok"):
            reply = Reply(message.get("result"), None)
        else:
            body = message.get("error") or {}
            reply = Reply(None, error_for_code(str(body.get("code", InternalError.code)),
                                               str(body.get("message", ""))))
        request_id = message.get("id")
        if isinstance(request_id, int) and 0 <= request_id < self._count:
            self._record(request_id, reply)
        else:
            log.error("HTTP %s: a reply for no request of it: %r", self.peer, message)
            self.fail(reply.error or InternalError("a reply matched no request"))
        return True

    def fail(self, error: ServerError) -> None:
        """Answer every request not yet answered with ``error``."""
        with self._lock:
            for request_id in range(self._count):
                self._replies.setdefault(request_id, Reply(None, error))
            complete = not self.future.done()
        if complete:
            self._delivery.deliver(self)

    def _record(self, request_id: int, reply: Reply) -> None:
        with self._lock:
            if request_id in self._replies:
                return
            self._replies[request_id] = reply
            complete = len(self._replies) == self._count
        if complete:
            self._delivery.deliver(self)


class Intake:
    """Threads that hand exchanges' requests to dispatch/, off the event loop.

    Args:
        dispatcher: The request handler every request goes through.
        threads: How many (tokenizing on several cores, as TCP's reader threads do).
    """

    def __init__(self, dispatcher: Dispatcher, threads: int,
                 purge: Callable[[], None] = lambda: None) -> None:
        self._dispatcher = dispatcher
        self._purge = purge
        self._queue: queue.SimpleQueue[tuple[Exchange, list[dict[str, Any]]] | None] = \
            queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"http-intake-{n}",
                                          daemon=True) for n in range(max(1, threads))]

    def start(self) -> None:
        """Start the threads."""
        for thread in self._threads:
            thread.start()

    def put(self, exchange: Exchange, messages: list[dict[str, Any]]) -> None:
        """Hand ``messages`` (numbered ``id`` 0..n-1) to dispatch/ for ``exchange``."""
        self._queue.put((exchange, messages))

    def client_gone(self, exchange: Exchange) -> None:
        """``exchange``'s client left: drop its queued work (and any other gone client's)
        from the models' queues, as a TCP connection's close does, off the event loop."""
        exchange.close()
        self._queue.put((exchange, []))

    def stop(self) -> None:
        """Stop the threads once they have handed on what was put before."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            taken = [item]
            while len(taken) < INTAKE_BURST:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # this thread's stop: after what it has taken
                    break
                taken.append(more)
            for exchange, messages in taken:
                self._hand_on(exchange, messages)
            try:
                self._dispatcher.flush()
            except Exception:  # noqa: BLE001 - the backends answer their own failures
                log.exception("HTTP intake: flushing the backends failed")

    def _hand_on(self, exchange: Exchange, messages: list[dict[str, Any]]) -> None:
        """Hand one exchange's messages to dispatch/; an exchange whose client left (no
        messages) purges the queues instead. Anything that escapes (dispatch/ answers every
        failure it knows) answers the exchange ``internal``: no request waits forever."""
        try:
            if not messages:
                self._purge()
            for message in messages:
                self._dispatcher.handle(message, exchange)
        except BaseException as exc:  # noqa: BLE001 - the thread must go on
            log.exception("HTTP %s: handing a request on failed", exchange.peer)
            exchange.fail(InternalError(f"{type(exc).__name__} while admitting the request"))
