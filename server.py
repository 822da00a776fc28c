"""A raw-TCP, msgpack-framed question-answering inference server.

    python prepare_model.py && python server.py        # 127.0.0.1:9999, 2 ONNX sessions
    python server.py --host 0.0.0.0 --inference_engine_type pytorch

A listener thread accepts connections; each connection's reader thread decodes frames, validates and
tokenizes requests, and puts them on one shared bounded queue. N inference-session threads, each with
its own engine, take batches from that queue and write every reply back on its client's socket.
See docs/architecture.md and docs/protocol.md.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

from engines import load_engine
from engines.base import Engine
from engines.batching import (
    BatchPolicy,
    DeadlineReaper,
    Responder,
    WorkItem,
    WorkQueue,
)
from engines.cost_model import CostModel
from engines.model_dir import ModelInfo, load_model_info
from engines.zero_engine import ZERO_ENGINE_WARNING
from engines.qa import QAConfig, QATask
from engines.pool import SessionPool
from engines.session import InferenceSession
from protocol.errors import BadRequest, ServerError, ShuttingDown, TooManyConnections
from protocol.messages import PingRequest, QARequest, Request, StatsRequest
from settings.server_config import ServerConfig, build_parser, config_from_args
from telemetry.stats import ServerStats
from transport import BindError, Connection, Listener, bind_socket, refuse
from transport.listener import publish_address
from transport.closing import DELIVERY_POLL_S

log = logging.getLogger("server")


class InferenceServer:
    """The assembled server. Use as a context manager, or ``start()`` then ``shutdown()``.

    Args:
        config: Serving settings; ``port=0`` picks a free port (see ``address``).
        engine_factory: Builds each session's engine; default: ``load_engine`` with the
            config's engine type, model folder, device and threads. Lets users (and tests) serve
            an engine of their own with the same QA task.
    """

    def __init__(self, config: ServerConfig,
                 engine_factory: Callable[[], Engine] | None = None) -> None:
        self.config = config
        self.engine_factory = engine_factory
        self.max_frame_size = config.max_frame_size
        self.send_timeout_s = config.send_timeout_s
        self.idle_timeout_s = config.idle_timeout_s
        self.frame_timeout_s = config.frame_timeout_s
        self.limits = config.limits()
        self.info: ModelInfo | None = None
        self.task: QATask | None = None
        self.queue = WorkQueue(config.max_queue)
        self.stats = ServerStats()
        self.metrics_address: tuple[str, int] | None = None
        self._metrics_httpd: Any = None
        self.pool: SessionPool | None = None
        self.policy = BatchPolicy(mode=config.batching)
        self.connections: set[Connection] = set()
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self._reaper = DeadlineReaper(self.queue)
        self._draining = False
        self._started = False  # start() completed: the server served

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the address, load the model into every session, then listen and accept.

        The address is bound first, so that a busy port fails at once, not after the model has
        loaded. A start that fails releases whatever it had started before raising.

        Raises:
            BindError: the address (or the metrics port) cannot be bound: taken, privileged,
                not this machine's.
            ModelDirError: no prepared model in ``model_dir``.
            RuntimeError: a session failed to load its engine.
        """
        cfg = self.config
        self._listener = Listener(bind_socket(cfg.host, cfg.port), self._accept)
        try:
            self._publish_address(False)  # a file left by an earlier run must not say "up"
            if cfg.metrics_port is not None:  # a port too: fail early; scrapes show the loading
                self._start_metrics(cfg.metrics_host, cfg.metrics_port)
            self._load()
            self._listener.start()
            self._publish_address(True)
        except BaseException:
            self._stop(timeout=5)
            raise
        self._started = True
        self._log_serving()

    def _publish_address(self, serving: bool) -> None:
        """Write (atomically) or remove ``--address_file``, if one is configured."""
        if self.config.address_file is not None:
            publish_address(self.config.address_file, self.address if serving else None)

    def _load(self) -> None:
        """Read the model folder, build the QA task and start the warmed-up sessions."""
        cfg = self.config
        self.info = load_model_info(cfg.model_dir)
        if cfg.inference_engine_type == "zero":  # whatever the folder holds, nothing runs it
            self.info = replace(self.info, meaningful=False, warning=ZERO_ENGINE_WARNING)
        log.info("loading %s into %d %s sessions (address %s:%d bound; accepting once loaded)",
                 self.info.model_name, cfg.num_inference_sessions, cfg.inference_engine_type,
                 *self.address)
        if not self.info.meaningful:
            log.warning("%s", self.info.warning)
        self.task = QATask.from_dir(cfg.model_dir, self._qa_config(self.info),
                                    input_names=self.info.input_names)
        self._start_sessions()
        self._reaper.start()

    def _start_metrics(self, host: str, port: int) -> None:
        from telemetry.prometheus import serve_metrics

        try:
            self._metrics_httpd = serve_metrics(self, host, port)
        except OSError as exc:
            raise BindError(exc.errno, f"cannot serve metrics on {host}:{port} (--metrics_port): "
                            f"{exc.strerror}") from exc
        self.metrics_address = self._metrics_httpd.server_address[:2]
        log.info("Prometheus metrics on http://%s:%d/metrics", *self.metrics_address)

    def _qa_config(self, info: ModelInfo) -> QAConfig:
        cfg = self.config
        no_answer = info.squad2 if cfg.no_answer == "auto" else cfg.no_answer == "on"
        return QAConfig(max_seq_len=min(cfg.max_seq_len, info.max_seq_len), doc_stride=cfg.doc_stride,
                        max_answer_len=cfg.max_answer_len, handle_impossible_answer=no_answer)

    def _start_sessions(self) -> None:
        cfg = self.config
        factory = self.engine_factory or partial(
            load_engine, cfg.inference_engine_type, cfg.model_dir, device=cfg.device,
            threads=cfg.engine_threads())
        assert self.task is not None
        task = self.task
        self.policy = BatchPolicy(mode=cfg.batching, max_items=cfg.max_batch_size,
                                  max_tokens=cfg.max_batch_tokens,
                                  max_delay_s=cfg.max_queue_delay_ms / 1000,
                                  lookahead=cfg.batch_lookahead, cost=CostModel())
        longest = task.config.max_seq_len
        warmup = sorted({n for n in (64, 128, 256) if n < longest} | {longest})

        def make(index: int, initial: bool) -> InferenceSession:
            # One session times the warm-up shapes for the shared cost model (sessions warming
            # at once would time each other's contention); every session primes its engine.
            timed = cfg.batching == "auto" and index == 0 and initial
            return InferenceSession(index, factory, task, self.queue, self.policy, self.stats,
                                    warmup=warmup if timed else ())

        self.pool = SessionPool(cfg.num_inference_sessions, make,
                                on_restart=lambda: self.stats.count_event("session_restart"))
        try:
            self.pool.start()
        except RuntimeError:
            self.queue.close()
            raise

    def _log_serving(self) -> None:
        cfg, info = self.config, self.info
        assert info is not None and self.pool is not None and self.pool.engine is not None
        host, port = self.address
        log.info("model: %s (%s) from %s", info.model_name, info.source, os.path.abspath(cfg.model_dir))
        log.info("engine: %s; %d inference sessions; batching %s (max %d requests, %d tokens, "
                 "delay %g ms)", self.pool.engine.describe(), cfg.num_inference_sessions,
                 cfg.batching, self.policy.cap, cfg.max_batch_tokens, cfg.max_queue_delay_ms)
        log.info("limits: queue %d, request timeout %g ms, %d connections, idle %g s, frame %g s, "
                 "frame size %d B, question %d chars, context %d chars (docs/operations.md)",
                 cfg.max_queue, cfg.request_timeout_ms, cfg.max_connections, cfg.idle_timeout_s,
                 cfg.frame_timeout_s, cfg.max_frame_size, cfg.max_question_chars,
                 cfg.max_context_chars)
        if cfg.batching == "auto":
            table = self.policy.cost.table() if self.policy.cost else {}
            log.info("batch cost model after warm-up (ms per batch, ROWSxLENGTH): %s",
                     ", ".join(f"{shape} {ms:.1f}" for shape, ms in table.items()))
        log.info("serving on %s:%d%s", host, port,
                 "" if host != "127.0.0.1" else " (local only; --host 0.0.0.0 to serve other machines)")

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        assert self._listener is not None, "server not started"
        host, port = self._listener.sock.getsockname()[:2]
        return host, port

    # -- what connections call -----------------------------------------------------------------
    def _accept(self, sock: socket.socket, peer: Any) -> None:
        with self._lock:
            full = len(self.connections) >= self.config.max_connections
            conn = None if full else Connection(sock, peer, self)
            if conn is not None:
                self.connections.add(conn)
        if conn is None:
            self.stats.count_event("connection_refused")
            refuse(sock, TooManyConnections(
                f"server has {self.config.max_connections} connections open (max_connections); "
                "retry later"))
            return
        self.stats.on_connection(True)
        try:
            conn.thread.start()
        except RuntimeError as exc:  # no threads left: this connection only is lost
            log.error("cannot serve connection %s: %s", conn.peer, exc)
            conn.close()
            conn.sock.close()
            self.forget(conn)

    def admit(self, request: QARequest, respond: Responder, alive: Any) -> None:
        """Check, tokenize and queue one request.

        Raises:
            BadRequest: a field over its cap, or text the model cannot take.
            ShuttingDown: the server is draining.
            Overloaded: the queue is full.
        """
        if self._draining:
            raise ShuttingDown("server is shutting down; request not admitted")
        assert self.task is not None
        self.limits.check(request)
        self.queue.check_room()  # a full queue refuses before the cost of tokenizing
        features = self.task.preprocess(request.question, request.context)
        admitted = time.monotonic()
        timeout_ms = request.timeout_ms or self.config.request_timeout_ms
        stats = self.stats

        def respond_and_count(result: dict[str, Any] | None, error: ServerError | None) -> None:
            # counted first, so stats never lag what a client has already seen
            stats.on_finished("ok" if error is None else error.code, time.monotonic() - admitted)
            respond(result, error)

        stats.on_admitted()
        try:
            self.queue.put(WorkItem(features=features, respond=respond_and_count, alive=alive,
                                    rows=features.rows, length=features.max_len,
                                    enqueued_at=admitted,
                                    deadline=admitted + timeout_ms / 1000 if timeout_ms else None))
        except BaseException:
            stats.on_refused()  # the caller replies and counts the error
            raise

    def control(self, request: Request) -> dict[str, Any]:
        """Answer a request that needs no engine: ``ping`` or ``stats``."""
        if isinstance(request, PingRequest):
            return {"pong": True, "ready": self.ready}
        if isinstance(request, StatsRequest):
            return self.stats_result()
        raise BadRequest(f"op {request.op!r} is not answered here", request_id=request.id)

    @property
    def ready(self) -> bool:
        """True while every session is loaded, warmed up and serving, and the server is not
        draining."""
        return self.pool is not None and self.pool.serving and not self._draining

    def stats_result(self) -> dict[str, Any]:
        """Counters and timings, plus what is being served and how: the ``stats`` op's result."""
        result = self.stats.snapshot()
        result["queue_depth"] = len(self.queue)
        result["ready"] = self.ready
        result["config"] = {k: v for k, v in asdict(self.config).items() if v is not None}
        if self.info is not None:
            result["model"] = {"name": self.info.model_name, "source": self.info.source,
                               "meaningful": self.info.meaningful}
            if self.info.warning:
                result["model"]["warning"] = self.info.warning
        result["batching"] = {"mode": self.config.batching, "max_batch_size": self.policy.cap,
                              "max_batch_tokens": self.config.max_batch_tokens,
                              "cost_model_ms": self.policy.cost.table() if self.policy.cost else {}}
        engine = self.pool.engine if self.pool is not None else None
        if engine is not None:
            result["engine"] = {"type": engine.name, "device": engine.device,
                                "description": engine.describe()}
        return result

    def forget(self, conn: Connection) -> None:
        """Drop a closed connection, and any work it left queued, which nobody awaits now."""
        with self._lock:
            self.connections.discard(conn)
        self.stats.on_connection(False)
        if conn.pending:
            for item in self.queue.purge(lambda item: not item.alive()):
                item.answered = True
                self.stats.on_finished("client_gone", None)

    # -- stop --------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop accepting, refuse new requests, answer every admitted one, close, join.

        Work still queued when ``timeout`` (default: the configured one) runs out is answered
        with ``shutting_down``; a batch an engine is still running is abandoned.

        Returns:
            True if every admitted request was run within ``timeout``.
        """
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        try:
            self._publish_address(False)  # draining is not serving: probes must not say "up"
        finally:
            drained = self._stop(timeout)
        if self._started:
            log.info("stopped (%s)", "all admitted requests answered" if drained else "timed out")
        return drained

    def _stop(self, timeout: float) -> bool:
        """Stop whatever has been started, in shutdown order; True if everything drained."""
        deadline = time.monotonic() + timeout
        if self._listener is not None:
            self._listener.stop()  # first stop accepting, then refuse new requests
        self._draining = True
        self.queue.close()
        drained = self.pool.join(timeout) if self.pool is not None else True
        if not drained:
            stopped = ShuttingDown("server stopped before this request could run")
            for item in self.queue.purge(lambda item: True):
                item.answer(None, stopped)
        with self._lock:
            connections = list(self.connections)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        finishing = connections  # each closes once its client has every reply, all at once
        while finishing := [conn for conn in finishing if not conn.finish()]:
            if left() <= 0:
                break
            time.sleep(DELIVERY_POLL_S)
        for conn in finishing:  # out of time: a client that does not read loses what is left
            conn.close()
        for conn in connections:
            conn.thread.join(left())
        if self._reaper.is_alive():
            self._reaper.join(1.0)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        return drained

    def __enter__(self) -> InferenceServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    """Command-line options -> ServerConfig (one flag per config field); sets up logging."""
    parser = build_parser(__doc__)
    parser.add_argument("--log_level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log detail")
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=args.pop("log_level"),
                        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    return config_from_args(parser, args)


def main(argv: list[str] | None = None) -> int:
    """Run until SIGINT/SIGTERM; a second signal exits at once. Returns the exit status."""
    config = parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s: stopping (again to force)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    server = InferenceServer(config)
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - any start failure is exit status 2, logged
        log.error("cannot start: %s", exc if isinstance(exc, BindError) else
                  f"{type(exc).__name__}: {exc}")
        return 2
    stop.wait()
    return 0 if server.shutdown() else 1


if __name__ == "__main__":
    sys.exit(main())
