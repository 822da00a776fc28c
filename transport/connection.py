"""Socket I/O for the framed protocol: one reader (and, when needed, one writer) per connection.

The wire format itself lives in protocol/ (sans-IO); this package only moves its bytes. What to do
with a request is dispatch/'s business: a connection hands each decoded message to
``server.handle(message, conn)`` and calls ``server.flush()``, ``server.stats`` and
``server.forget(conn)``; it needs nothing else from the server.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from typing import Any

from protocol import FrameDecoder, encode_frame, error_reply
from protocol.errors import FrameTimeout, IdleTimeout, ProtocolError, ServerError
from protocol.replies import encoded_reply
from transport.closing import DELIVERY_POLL_S
from transport.coalesce import holding
from transport.hooks import Expiry, ServerHooks
from transport.stream import PlainStream, peer_name
from transport.tls import TLSStream

log = logging.getLogger("server.transport")


#: Unsent reply bytes above which the reader stops reading requests until the client catches up.
OUTBOX_HIGH_WATER = 1 << 20
#: Longest single poll of a reader, in ms; it then looks at its clocks again.
POLL_MAX_MS = 60_000


class Connection:
    """One client socket: a reader thread that admits requests, and a never-blocking writer.

    Replies come from session threads in any order. ``send`` writes a frame at once if the socket
    takes it whole (the usual case) and otherwise appends it to an outbox that a writer thread,
    started on first need, flushes; so a client that does not read never blocks a session. The
    reader stops reading while the outbox is over ``OUTBOX_HIGH_WATER``; replies to requests it
    already admitted still join it, up to the server's ``max_outbox_bytes`` (with the chunk being
    written), past which the connection is closed (event ``outbox_overflow``); and a writer that
    cannot send for ``send_timeout_s`` closes it too, so memory per connection stays bounded.

    The reader closes a connection that sent nothing and awaits nothing for ``idle_timeout_s``,
    and one whose frame takes longer than ``frame_timeout_s`` to arrive once begun. After the peer
    half-closes, replies still in flight are delivered before the socket closes. A connection
    ended on purpose (a fatal error, the server's stop) shuts its write side first and closes only
    once the client has received every reply (transport/closing.py).

    The socket may be TCP or Unix. With ``tls``, the reader thread first completes the TLS
    handshake, within ``tls_handshake_timeout_s`` (transport/tls.py), and every byte then moves
    through the TLS stream; the listener thread only wraps the socket, which does no I/O.
    """

    def __init__(self, sock: socket.socket, peer: Any, server: ServerHooks, *,
                 tls: ssl.SSLContext | None = None) -> None:
        self.peer = peer_name(sock, peer)
        self.stream = PlainStream(sock, server.send_timeout_s) if tls is None else \
            TLSStream(sock, tls, server.send_timeout_s)
        self.sock = self.stream.sock
        self.server = server
        self.decoder = FrameDecoder(server.max_frame_size)
        self._cond = threading.Condition()  # guards everything below
        self._pending = 0  # admitted requests not yet answered
        self._outbox = bytearray()
        self._held = bytearray()  # frames held by coalesced_sends, written at its end
        self._writing = False
        self._writing_bytes = 0  # the chunk the writer is sending, out of the outbox
        self._writer: threading.Thread | None = None
        self._open = True
        self._ending = False  # a fatal error reply was sent: nothing more is sent or run
        self._fin_queued = False  # finishing: the write side is shut behind the last reply
        self._last_activity = time.monotonic()
        self._frame_started = 0.0
        self._deadline: tuple[float, Expiry] | None = None  # see set_deadline
        self.state: Any = None  # dispatch/'s per-connection state (auth); never read here
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN)
        self.thread = threading.Thread(target=self.serve, name=f"conn-{self.peer}", daemon=True)

    def is_open(self) -> bool:
        """False once the connection is closed or ending after a fatal error (queued work for
        it is then skipped)."""
        return self._open and not self._ending

    @property
    def pending(self) -> int:
        """Admitted requests not yet answered."""
        return self._pending

    def serve(self) -> None:
        """Reader thread body: read, decode and admit until EOF, error or shutdown."""
        try:
            if not self._handshake():
                return
            if self._read_loop():  # fatal: deliver the error reply only, then linger
                self._linger()
            else:
                self._wait_for_pending()
        except Exception:  # noqa: BLE001 - a broken connection never takes the server down
            log.exception("connection %s failed", self.peer)
        finally:
            self.close()
            if self._writer is not None:
                self._writer.join()
            self.stream.close()  # only now: no thread of ours still uses the descriptor
            self.server.forget(self)

    def _handshake(self) -> bool:
        """Set up the stream (TLS: the handshake, bounded); False if the connection ends."""
        failure = self.stream.handshake(self.server.tls_handshake_timeout_s, self.is_open)
        if failure is None:
            return True
        if self.is_open():  # not a stop of ours: count it
            log.info("connection %s: TLS handshake failed (%s); closing", self.peer, failure)
            self.server.stats.count_event("tls_handshake_failed")
        return False

    def _read_loop(self) -> bool:
        """Read until EOF, reset or a fatal error; True if a fatal error reply was sent."""
        while self._open:
            if (timeout := self._await_data()) is not None:
                log.info("connection %s: %s; closing", self.peer, timeout.message)
                self.send(error_reply(None, timeout), final=True)
                return True
            try:
                data = self.stream.recv(65536)
            except OSError:  # reset: the client is gone, not half-closed; drop its queued work
                self.close()
                return False
            if data is None:  # TLS: a record not complete yet
                continue
            if self._ending:  # finishing (the server stops): input is only drained
                if not data:
                    return False
                continue
            self._last_activity = time.monotonic()
            if not self.decoder.buffered:
                self._frame_started = self._last_activity
            self.decoder.receive_data(data)
            try:
                while not self._ending and (message := self.decoder.next_message()) is not None:
                    self._frame_started = time.monotonic()  # the next frame starts now
                    self.server.handle(message, self)  # may end the connection (final reply)
            except ProtocolError as exc:
                log.info("connection %s: %s; closing", self.peer, exc)
                self.server.stats.count("frame", exc.code)
                self.send(error_reply(None, exc), final=True)
                return True
            finally:
                self.server.flush()  # what this read admitted goes on together
            if self._ending:  # the handler sent a fatal reply: the rest is not read
                return True
            if not data:
                return False
        return False

    def _linger(self) -> None:
        """After a fatal error reply: finish (transport/closing.py) while reading and discarding
        what the client still sends, until the client has received everything or the send
        timeout passes, so that closing does not reset the connection before the client has
        the reply."""
        until = time.monotonic() + self.server.send_timeout_s
        reading = True
        while not self.finish() and time.monotonic() < until:
            if not reading:  # the client half-closed: its replies may still be on their way
                time.sleep(DELIVERY_POLL_S)
            elif self.stream.buffered() or self._poll.poll(int(DELIVERY_POLL_S * 1000)):
                try:
                    data = self.stream.recv(65536)
                except OSError:
                    return  # reset: the client is gone
                reading = data is None or bool(data)

    def _await_data(self) -> ServerError | None:
        """Block until bytes (or EOF) can be read; the timeout error if one ran out first."""
        while True:
            with self._cond:
                blocked = time.monotonic()
                self._cond.wait_for(lambda: len(self._outbox) < OUTBOX_HIGH_WATER
                                    or not self._open)  # the client must read to be read
                self._frame_started += time.monotonic() - blocked  # our wait, not the client's
            now = time.monotonic()
            until, expire = self._read_deadline(now)
            # capped: a huge timeout must not overflow poll, and a busy connection's idle clock
            # restarts at its last reply, which does not wake the poll
            wait_ms = None if until is None else max(0, min(int((until - now) * 1000) + 1,
                                                            POLL_MAX_MS))
            if self.stream.buffered() or self._poll.poll(wait_ms) or not self._open:
                return None
            if expire is not None and time.monotonic() >= until:  # type: ignore[operator]
                return expire()

    def set_deadline(self, at: float | None, expire: Expiry | None = None) -> None:
        """Unless cleared (``at`` None) first, close the connection at ``time.monotonic()``
        ``at`` with the fatal reply ``expire()`` builds (dispatch/auth.py: the time a connection
        has to authenticate). Reader thread, or before it starts."""
        self._deadline = None if at is None or expire is None else (at, expire)

    def _read_deadline(self, now: float) -> tuple[float | None, Expiry | None]:
        """When to give up waiting for bytes, and what builds the error to send then (None:
        look again). Only the builder: the error itself is built only if it fires."""
        until, expire = self._limit_deadline(now)
        if self._deadline is not None and (until is None or self._deadline[0] <= until):
            return self._deadline
        return until, expire

    def _limit_deadline(self, now: float) -> tuple[float | None, Expiry | None]:
        """``_read_deadline`` of the frame and idle timeouts alone."""
        frame_s, idle_s = self.server.frame_timeout_s, self.server.idle_timeout_s
        if self.decoder.buffered and frame_s > 0:
            return self._frame_started + frame_s, self._frame_timeout
        if idle_s <= 0:
            return None, None
        if self._pending or self._outbox or self._writing or self._held:
            return now + min(idle_s, 1.0), None  # not idle: replies are owed; look again soon
        return self._last_activity + idle_s, self._idle_timeout

    def _frame_timeout(self) -> ServerError:
        self.server.stats.count_event(FrameTimeout.code)
        return FrameTimeout(f"frame not completed within {self.server.frame_timeout_s:g} s "
                            "(frame_timeout)")

    def _idle_timeout(self) -> ServerError:
        self.server.stats.count_event(IdleTimeout.code)
        return IdleTimeout(f"no request for {self.server.idle_timeout_s:g} s (idle_timeout)")

    def begin(self) -> None:
        """An admitted request is now owed a reply (``reply``) or a ``release``."""
        with self._cond:
            self._pending += 1

    def release(self) -> None:
        """An admitted request is no longer owed: answered, refused after all, or its
        client gone. Any thread."""
        with self._cond:
            self._pending -= 1
            self._last_activity = time.monotonic()
            self._cond.notify_all()

    @staticmethod
    def encode_reply(request_id: int, result: dict[str, Any] | None,
                     error: ServerError | None) -> tuple[bytes, ServerError | None]:
        """One admitted request's reply frame, and its error (protocol/replies.py)."""
        return encoded_reply(request_id, result, error)

    def send_reply(self, frame: bytes) -> None:
        """Send the encoded reply of one admitted request (from any thread; never blocks)."""
        try:
            self.send_frame(frame)
        finally:  # whatever happened, this request is no longer owed
            self.release()

    def send(self, message: dict[str, Any], final: bool = False) -> bool:
        """Encode ``message`` and ``send_frame`` it."""
        return self.send_frame(encode_frame(message), final)

    def send_frame(self, frame: bytes, final: bool = False) -> bool:
        """Send one frame, or queue it for the writer, without blocking.

        Args:
            frame: The encoded reply.
            final: This is a fatal error reply: nothing is sent after it.

        Returns:
            False if the connection is closed or ending (the frame is dropped).
        """
        with self._cond:
            if not self._open or self._ending:
                return False
            if final:  # replies held before the fatal one go out before it
                self._flush_held_locked()
            self._ending = final
            if not final and holding(self):
                self._held += frame
                return True
            return self._write_locked(frame)

    def flush_held(self) -> None:
        """Write the frames ``coalesced_sends`` held for this connection (as one write)."""
        with self._cond:
            self._flush_held_locked()

    def _flush_held_locked(self) -> None:
        """Write the held frames, unless the connection is closed or ending (lock held)."""
        if self._held:
            frame, self._held = bytes(self._held), bytearray()
            if self._open and not self._ending:
                self._write_locked(frame)
            self._cond.notify_all()

    def _write_locked(self, frame: bytes) -> bool:
        """Send ``frame`` now if the socket takes it, else queue it for the writer (lock held).
        False if the connection had to close."""
        if not self._outbox and not self._writing:
            try:  # the usual case: the socket buffer takes the whole frame now
                frame = frame[self.stream.send_now(frame):]
            except OSError as exc:
                log.info("connection %s: send failed (%s); closing", self.peer, exc)
                self._close_locked()
                return False
            if not frame:
                return True
        self._outbox += frame
        if len(self._outbox) + self._writing_bytes > self.server.max_outbox_bytes:
            return self._overflow_locked()
        if self._writer is None and not self._start_writer():
            return False
        self._cond.notify_all()
        return True

    def _overflow_locked(self) -> bool:
        """The client left more replies unread than the cap: close (lock held); False."""
        log.warning("connection %s: %d bytes of replies unread, over --max_outbox_mb; closing",
                    self.peer, len(self._outbox) + self._writing_bytes)
        self.server.stats.count_event("outbox_overflow")
        self._close_locked()
        return False

    def _start_writer(self) -> bool:
        """Start the writer thread (lock held); on failure (no threads left) close."""
        writer = threading.Thread(target=self._write_loop, daemon=True, name=f"writer-{self.peer}")
        try:
            writer.start()
        except RuntimeError as exc:
            log.error("connection %s: cannot start a writer (%s); closing", self.peer, exc)
            self._close_locked()
            return False
        self._writer = writer  # published only once started: serve() joins it
        return True

    def _write_loop(self) -> None:
        """Writer thread body: flush the outbox, blocking (up to the send timeout) per write."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._outbox) or not self._open)
                if not self._open:
                    return
                data, self._outbox = bytes(self._outbox), bytearray()
                self._writing, self._writing_bytes = True, len(data)
            try:
                self.stream.send_all(data)
                failure = None
            except OSError as exc:
                failure = exc
            with self._cond:
                self._writing, self._writing_bytes = False, 0
                self._cond.notify_all()
                if failure is not None and self._open:  # our own close (overflow) is no timeout
                    log.info("connection %s: client not reading (%s); closing", self.peer, failure)
                    self.server.stats.count_event("send_timeout")
                    self._close_locked()
                    return

    def finish(self) -> bool:
        """One step of an orderly close, never blocking; call until it returns True.

        From the first call nothing more is sent and input is drained, no longer handled. Once
        the queued replies are handed to the socket, a FIN is queued behind them; once the
        client has acknowledged every byte, the connection closes (closing earlier could reset
        it and destroy replies still in flight).

        Returns:
            True once the connection is closed.
        """
        with self._cond:  # the reader closes the descriptor only after _open turns False
            self._flush_held_locked()  # replies sent before the stop began
            self._ending = True
            if not self._open:
                return True
            if self._outbox or self._writing or self._held:
                return False
            if not self._fin_queued:
                self._fin_queued = self.stream.shut_write()
            if self._fin_queued and not self.stream.delivered():
                return False
            self._close_locked()
            return True

    def _wait_for_pending(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._open or (
                self._pending <= 0 and not self._outbox and not self._writing
                and not self._held))

    def close(self) -> None:
        """End the connection once; wakes the reader, the writer and any waiter. Any thread."""
        with self._cond:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self._open:
            return
        self._open = False
        self._outbox.clear()
        self.stream.abort()  # the reader thread closes the descriptor
        self._cond.notify_all()

