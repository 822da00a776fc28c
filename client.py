"""Client for the QA inference server: a library (``Client``) and an interactive REPL.

    python client.py                                   # REPL against 127.0.0.1:9999
    python client.py --context_file article.txt        # REPL, starting with that text
    python client.py --question "Who?" --context "Bob went home."

Library use::

    from client import Client
    with Client("127.0.0.1", 9999) as c:
        print(c.answer("Who went home?", "Bob went home."))
        futures = [c.submit(q, ctx) for q in questions]   # pipelined on one connection
"""

from __future__ import annotations

import argparse
import itertools
import socket
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin from 3.11
from pathlib import Path
from typing import Any

from console.text_input import read_text
from protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    FrameDecoder,
    ProtocolError,
    ServerError,
    encode_frame,
    parse_reply,
    ping_request,
    qa_request,
    stats_request,
)
from settings.cli import HelpFormatter, shout


class ConnectionLost(ConnectionError):
    """The connection closed (or broke) before the reply arrived."""


class Client:
    """One TCP connection to the server, safe to share between threads.

    Requests may be pipelined: ``submit`` sends at once and returns a Future; a background reader
    thread matches replies to futures by ``id``. Server errors are raised as the typed exceptions
    of ``protocol.errors`` (each carries the wire ``code``).

    Args:
        host: Server address.
        port: Server port.
        connect_timeout: Seconds to wait for the TCP connection.
        max_frame_size: Largest reply frame accepted.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9999, *, connect_timeout: float = 10.0,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.address = (host, port)
        self._sock = socket.create_connection(self.address, timeout=connect_timeout)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._decoder = FrameDecoder(max_frame_size)
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed: BaseException | None = None
        self._reader = threading.Thread(target=self._read_loop, name="client-reader", daemon=True)
        self._reader.start()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, question: str, context: str, *,
               timeout_ms: float | None = None) -> Future[dict[str, Any]]:
        """Send a ``qa`` request now; the Future resolves to ``{answer, score, start, end}``.

        Args:
            timeout_ms: The request's deadline on the server, from admission: a request still
                queued then fails with ``DeadlineExceeded`` and is never run. None: the server's
                default (``--request_timeout_ms``).
        """
        return self.request(lambda rid: qa_request(rid, question, context, timeout_ms))

    def answer(self, question: str, context: str, timeout: float | None = None) -> dict[str, Any]:
        """Ask one question and wait for the answer.

        With ``timeout``, the server gets the same deadline, so it does not run a request nobody
        waits for any more.

        Raises:
            ServerError: a subclass matching the server's error code (e.g. BadRequest,
                Overloaded, DeadlineExceeded).
            ConnectionLost: the connection closed first.
            TimeoutError: no reply within ``timeout`` seconds.
        """
        timeout_ms = None if timeout is None else 1000 * timeout
        return self.wait(self.submit(question, context, timeout_ms=timeout_ms), timeout)

    def ping(self, timeout: float | None = None) -> dict[str, Any]:
        """Round trip to the server; returns its ping result (``pong``, ``ready``)."""
        return self.wait(self.request(ping_request), timeout)

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """The server's counters, timings and configuration (see docs/metrics.md)."""
        return self.wait(self.request(stats_request), timeout)

    def wait(self, future: Future[dict[str, Any]], timeout: float | None) -> dict[str, Any]:
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

    def request(self, build: Any) -> Future[dict[str, Any]]:
        """Send ``build(request_id)`` (a request map) and return the Future of its result."""
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._closed is not None:
                raise ConnectionLost(f"connection to {self.address} is closed") from self._closed
            request_id = next(self._ids)
            self._pending[request_id] = future
        frame = encode_frame(build(request_id))
        try:
            with self._send_lock:
                self._sock.sendall(frame)
        except OSError as exc:
            self._fail_all(ConnectionLost(f"send failed: {exc}"))
        return future

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
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(timeout=5)
        self._fail_all(ConnectionLost("client closed"))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def print_answer(result: dict[str, Any], elapsed_ms: float) -> None:
    """Print one answer as the REPL shows it."""
    answer = result["answer"] or "(no answer)"
    print(f"  answer: {answer}")
    print(f"  score: {result['score']:.4f}  span: [{result['start']}, {result['end']})  "
          f"latency: {elapsed_ms:.1f} ms")


REPL_HELP = ("Paste or type a text, then press Enter on an empty line; ask questions about it, one "
             "per line.\nAn empty question asks for a new text. Ctrl+D quits.")
TEXT_PROMPT = "\ntext (end with an empty line)> "
QUESTION_PROMPT = "question (empty: new text)> "


def model_warning(client: Client, timeout: float = 10.0) -> str | None:
    """The server's warning if its model's answers are not meaningful (None if they are, or if
    the server does not say)."""
    try:
        model = client.stats(timeout=timeout).get("model", {})
    except (ServerError, ConnectionLost, FutureTimeout):
        return None
    if model.get("meaningful", True):
        return None
    return model.get("warning") or f"the answers of model {model.get('name')} are not meaningful"


def repl(client: Client, context: str | None = None) -> None:
    """Ask for a text, then answer questions about it until EOF (Ctrl+D) or Ctrl+C.

    Args:
        client: The connection to use (replaced by a fresh one if the server closes it).
        context: The first text, if already known (``--context`` or ``--context_file``).
    """
    print(f"connected to {client.address[0]}:{client.address[1]} ({client.ping()})")
    if warning := model_warning(client):
        shout(warning)
    print(REPL_HELP)
    try:
        while True:
            text, context = context or read_text(TEXT_PROMPT), None
            if not text:
                print("  (empty text: paste or type a text, then press Enter on an empty line; "
                      "Ctrl+D quits)")
                continue
            print(f"  ({len(text):,} characters)")
            client = answer_questions(client, text)
    except (EOFError, KeyboardInterrupt):
        print()
    except OSError as exc:
        print(f"connection to {client.address[0]}:{client.address[1]} lost: {exc}")


def answer_questions(client: Client, text: str) -> Client:
    """Answer questions about ``text`` until an empty one; returns the client in use."""
    while question := input(QUESTION_PROMPT).strip():
        started = time.perf_counter()
        try:
            client, result = ask(client, question, text)
        except ServerError as exc:
            print(f"  error [{exc.code}]: {exc.message}")
            continue
        print_answer(result, (time.perf_counter() - started) * 1000)
    return client


def ask(client: Client, question: str, context: str) -> tuple[Client, dict[str, Any]]:
    """Answer one question, reconnecting once if the server had closed the connection (it
    closes idle ones); returns the client in use and the answer."""
    try:
        return client, client.answer(question, context)
    except ConnectionLost:
        client.close()
        fresh = Client(*client.address)
        return fresh, fresh.answer(question, context)


def probe(client: Client, timeout: float) -> int:
    """Print the ping result; 0 if the server says it is ready, else 1."""
    try:
        result = client.ping(timeout=timeout)
    except (ServerError, ConnectionLost, FutureTimeout) as exc:
        print(f"not ready: {exc!r}", file=sys.stderr)
        return 1
    print(result)
    return 0 if result.get("ready") else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the context comes back in ``args.context`` whichever flag gave it."""
    p = argparse.ArgumentParser(
        description="Ask the QA inference server questions. Without --question it starts the "
        "interactive REPL: paste or type a text, then ask questions about it.",
        formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the server's address")
    p.add_argument("--port", type=int, default=9999, help="the server's port")
    p.add_argument("--address_file", help="read the server's HOST:PORT from this file, written "
                   "by server.py --address_file once it serves (instead of --host and --port)")
    p.add_argument("--question", help="answer this once and exit (needs --context or "
                   "--context_file); without it, the REPL runs")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--context", help="the text the question is about (REPL: the first text)")
    text.add_argument("--context_file", help="read the text from this UTF-8 file, any length")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for an answer")
    p.add_argument("--ready", action="store_true",
                   help="health probe: exit 0 if the server is ready, 1 if not, 2 if unreachable")
    args = p.parse_args(argv)
    if args.context_file is not None:
        try:
            args.context = Path(args.context_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            p.error(f"cannot read --context_file: {exc}")
    if args.question is not None and args.context is None:
        p.error("--question needs --context or --context_file")
    return args


def one_shot(client: Client, question: str, context: str, timeout: float) -> int:
    """Answer one question and print it; returns the exit status."""
    if warning := model_warning(client, timeout):
        shout(warning, sys.stderr)
    started = time.perf_counter()
    try:
        result = client.answer(question, context, timeout=timeout)
    except ServerError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 1
    print_answer(result, (time.perf_counter() - started) * 1000)
    return 0


def read_address_file(path: str) -> tuple[str, int]:
    """(host, port) from a server's ``--address_file``; a wildcard host means this machine.

    Raises:
        OSError: no such file (the server is not serving), or it does not hold HOST:PORT.
    """
    text = Path(path).read_text(encoding="utf-8").strip()
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise OSError(f"{path} holds {text!r}, not HOST:PORT")
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host), int(port)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = parse_args(argv)
    try:
        if args.address_file is not None:
            args.host, args.port = read_address_file(args.address_file)
        client = Client(args.host, args.port)
    except OSError as exc:
        where = args.address_file or f"{args.host}:{args.port}"
        print(f"cannot connect to {where}: {exc}", file=sys.stderr)
        return 2
    with client:
        if args.ready:
            return probe(client, args.timeout)
        if args.question is None:
            repl(client, args.context)
            return 0
        return one_shot(client, args.question, args.context, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
