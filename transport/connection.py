"""Socket I/O for the framed protocol: the accept loop and one reader/writer per connection.

The wire format itself lives in protocol/ (sans-IO); this package only moves its bytes. What to do
with an admitted request is the server's business: a connection calls ``server.admit(...)``,
``server.control(...)``, ``server.stats`` and ``server.forget(conn)`` and needs nothing else from it.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from engines.batching import Responder
from protocol import FrameDecoder, encode_frame, error_reply, ok_reply, parse_request
from protocol.errors import InternalError, ProtocolError, ServerError
from protocol.messages import REQUEST_PARSERS, QARequest, Request
from telemetry.stats import ServerStats

log = logging.getLogger("server.transport")


class ServerHooks(Protocol):
    """What a connection needs from the server that owns it."""

    max_frame_size: int
    send_timeout_s: float
    stats: ServerStats

    def admit(self, request: QARequest, respond: Responder, alive: Callable[[], bool]) -> None:
        """Tokenize and queue one request, or raise a ServerError for it."""

    def control(self, request: Request) -> dict[str, Any]:
        """The result of a request answered at once, without the queue (ping, stats)."""

    def forget(self, conn: Connection) -> None:
        """The connection has closed."""


class Connection:
    """One client socket: a reader thread that admits requests, and a locked writer for replies.

    Replies come from session threads (any order); a lock keeps whole frames from interleaving.
    After the peer half-closes, replies still in flight are delivered before the socket closes.
    """

    def __init__(self, sock: socket.socket, peer: tuple[Any, ...], server: ServerHooks) -> None:
        self.sock = sock
        self.peer = f"{peer[0]}:{peer[1]}"
        self.server = server
        self.decoder = FrameDecoder(server.max_frame_size)
        self._write_lock = threading.Lock()
        self._pending = 0
        self._pending_done = threading.Condition()
        self._open = True
        _set_send_timeout(sock, server.send_timeout_s)
        # Each reply is one small write; without this, Nagle's algorithm can hold a pipelined
        # reply until the client acknowledges the previous one (up to a delayed-ACK timeout).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.thread = threading.Thread(target=self.serve, name=f"conn-{self.peer}", daemon=True)

    def is_open(self) -> bool:
        """False once the socket is closed (queued work for it is then skipped)."""
        return self._open

    def serve(self) -> None:
        """Reader thread body: read, decode and admit until EOF, error or shutdown."""
        try:
            self._read_loop()
            self._wait_for_pending()
        except Exception:  # noqa: BLE001 - a broken connection never takes the server down
            log.exception("connection %s failed", self.peer)
        finally:
            self.close()
            self.server.forget(self)

    def _read_loop(self) -> None:
        while self._open:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            self.decoder.receive_data(data)
            try:
                while (message := self.decoder.next_message()) is not None:
                    self.handle(message)
            except ProtocolError as exc:
                log.info("connection %s: %s; closing", self.peer, exc)
                self.server.stats.count("frame", exc.code)
                self.send(error_reply(None, exc))
                return
            if not data:
                return

    def handle(self, message: Any) -> None:
        """Validate one decoded request and answer it or admit it to the work queue."""
        request_id = None
        op = _op_name(message)
        try:
            request = parse_request(message)
            request_id = request.id
            if isinstance(request, QARequest):
                self._admit(request)
                return
            self.send(ok_reply(request_id, self.server.control(request)))
            self.server.stats.count(op, "ok")
        except ServerError as exc:
            rid = exc.request_id if exc.request_id is not None else request_id
            self.send(error_reply(rid, exc))
            self.server.stats.count(op, exc.code)
        except Exception as exc:  # noqa: BLE001 - one bad request fails alone
            log.exception("connection %s: unexpected error handling a request", self.peer)
            self.send(error_reply(request_id, InternalError(f"{type(exc).__name__}: {exc}")))
            self.server.stats.count(op, InternalError.code)

    def _admit(self, request: QARequest) -> None:
        with self._pending_done:
            self._pending += 1  # before admitting: the reply may come before admit returns
        try:
            self.server.admit(request, partial(self.reply, request.id), self.is_open)
        except BaseException:
            with self._pending_done:
                self._pending -= 1
            raise

    def reply(self, request_id: int, result: dict[str, Any] | None,
              error: ServerError | None) -> None:
        """Responder for one admitted request (called from a session thread)."""
        message = ok_reply(request_id, result or {}) if error is None else error_reply(request_id, error)
        self.send(message)
        with self._pending_done:
            self._pending -= 1
            self._pending_done.notify_all()

    def send(self, message: dict[str, Any]) -> bool:
        """Write one frame; on any socket error (or send timeout) close the connection."""
        frame = encode_frame(message)
        with self._write_lock:
            if not self._open:
                return False
            try:
                self.sock.sendall(frame)
                return True
            except OSError as exc:
                log.info("connection %s: send failed (%s); closing", self.peer, exc)
        self.close()
        return False

    def _wait_for_pending(self) -> None:
        with self._pending_done:
            self._pending_done.wait_for(lambda: self._pending <= 0 or not self._open)

    def close(self) -> None:
        """Close the socket once; wakes the reader and any waiter. Safe from any thread."""
        with self._write_lock:
            if not self._open:
                return
            self._open = False
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
        with self._pending_done:
            self._pending_done.notify_all()


def _op_name(message: Any) -> str:
    """The request's op for counting: a known op's name, else "invalid"."""
    op = message.get("op") if isinstance(message, dict) else None
    return op if isinstance(op, str) and op in REQUEST_PARSERS else "invalid"


def _set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound how long a reply may block on a client that does not read (Linux SO_SNDTIMEO)."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    except OSError:
        log.debug("SO_SNDTIMEO not supported here")


class Listener(threading.Thread):
    """Accepts connections until stopped; blocks in a selector, woken by a socket pair to stop."""

    def __init__(self, sock: socket.socket, on_accept: Callable[[socket.socket, Any], None]) -> None:
        super().__init__(name="listener", daemon=True)
        self.sock = sock
        self.on_accept = on_accept
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def run(self) -> None:
        """Accept loop."""
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_r:
                    return
                try:
                    client, peer = self.sock.accept()
                except OSError as exc:  # e.g. EMFILE: log, keep serving the others
                    log.warning("accept failed: %s", exc)
                    continue
                self.on_accept(client, peer)

    def stop(self) -> None:
        """Stop accepting and close the listening socket."""
        self._wake_w.send(b"x")
        self.join()
        self._selector.close()
        for s in (self.sock, self._wake_r, self._wake_w):
            s.close()
