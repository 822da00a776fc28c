"""A raw-TCP, msgpack-framed question-answering inference server.

    python prepare_model.py && python server.py        # 127.0.0.1:9999, 2 ONNX sessions
    python server.py --host 0.0.0.0 --inference_engine_type pytorch

A listener thread accepts connections; each connection's reader thread decodes frames, validates and
tokenizes requests, and puts them on one shared bounded queue. N inference-session threads, each with
its own engine, take batches from that queue and write every reply back on its client's socket.
See docs/architecture.md and docs/protocol.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from engines import ENGINE_TYPES, load_engine
from engines.base import Engine
from engines.batching import BATCHING_MODES, BatchPolicy, Responder, WorkItem, WorkQueue
from engines.cost_model import CostModel
from engines.model_dir import ModelDirError, ModelInfo, load_model_info
from engines.qa import QAConfig, QATask
from engines.session import InferenceSession
from protocol import DEFAULT_MAX_FRAME_SIZE
from protocol.errors import BadRequest, ServerError, ShuttingDown
from protocol.messages import PingRequest, QARequest, Request, StatsRequest
from telemetry.stats import ServerStats
from transport import Connection, Listener

log = logging.getLogger("server")


@dataclass(kw_only=True)
class ServerConfig:
    """Every serving setting; the CLI flags of the same names fill it."""

    host: str = "127.0.0.1"
    port: int = 9999
    num_inference_sessions: int = 2
    inference_engine_type: str = "onnx"
    model_dir: str = "saved_models"
    device: str = "auto"
    threads_per_session: int = 0  # 0: the machine's cores shared among sessions
    batching: str = "auto"  # auto (cost-aware), fixed, off
    max_batch_size: int = 32
    max_batch_tokens: int = 16384  # rows x padded length per batch
    max_queue_delay_ms: float = 2.0
    batch_lookahead: int = 128
    max_queue: int = 1024
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    send_timeout_s: float = 30.0
    no_answer: str = "auto"  # auto (from the model's metadata), on, off
    max_seq_len: int = 384
    doc_stride: int = 128
    max_answer_len: int = 15
    shutdown_timeout_s: float = 30.0
    metrics_port: int | None = None  # Prometheus /metrics; None: off
    metrics_host: str = "127.0.0.1"

    def engine_threads(self) -> int:
        """Threads per engine: as configured, else the machine's cores shared among sessions."""
        if self.threads_per_session > 0:
            return self.threads_per_session
        return max(1, (os.cpu_count() or 1) // max(1, self.num_inference_sessions))


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
        self.info: ModelInfo | None = None
        self.task: QATask | None = None
        self.queue = WorkQueue(config.max_queue)
        self.stats = ServerStats()
        self.metrics_address: tuple[str, int] | None = None
        self._metrics_httpd: Any = None
        self.sessions: list[InferenceSession] = []
        self.policy = BatchPolicy(mode=config.batching)
        self.connections: set[Connection] = set()
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self._draining = False

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model into every session, then bind and start accepting.

        Raises:
            ModelDirError: no prepared model in ``model_dir``.
            RuntimeError: a session failed to load its engine.
        """
        cfg = self.config
        self.info = load_model_info(cfg.model_dir)
        if not self.info.meaningful:
            log.warning("%s", self.info.warning)
        self.task = QATask.from_dir(cfg.model_dir, self._qa_config(self.info),
                                    input_names=self.info.input_names)
        self._start_sessions()
        sock = socket.create_server((cfg.host, cfg.port), backlog=512)
        self._listener = Listener(sock, self._accept)
        self._listener.start()
        if cfg.metrics_port is not None:
            self._start_metrics(cfg.metrics_host, cfg.metrics_port)
        self._log_serving()

    def _start_metrics(self, host: str, port: int) -> None:
        from telemetry.prometheus import serve_metrics

        self._metrics_httpd = serve_metrics(self, host, port)
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
        self.policy = BatchPolicy(mode=cfg.batching, max_items=cfg.max_batch_size,
                                  max_tokens=cfg.max_batch_tokens,
                                  max_delay_s=cfg.max_queue_delay_ms / 1000,
                                  lookahead=cfg.batch_lookahead, cost=CostModel())
        longest = self.task.config.max_seq_len
        warmup = sorted({n for n in (64, 128, 256) if n < longest} | {longest})
        # One session times the warm-up shapes for the shared cost model (sessions warming at
        # once would time each other's contention); every session primes its engine.
        self.sessions = [InferenceSession(i, factory, self.task, self.queue, self.policy,
                                          self.stats,
                                          warmup=warmup if cfg.batching == "auto" and i == 0 else ())
                         for i in range(cfg.num_inference_sessions)]
        for session in self.sessions:
            session.start()
        for session in self.sessions:
            session.ready.wait()
        failed = [s for s in self.sessions if s.load_error is not None]
        if failed:
            self.queue.close()
            error = failed[0].load_error
            raise RuntimeError(f"{failed[0].name} could not load its engine: {error}") from error

    def _log_serving(self) -> None:
        cfg, info = self.config, self.info
        assert info is not None and self.sessions[0].engine is not None
        host, port = self.address
        log.info("model: %s (%s) from %s", info.model_name, info.source, os.path.abspath(cfg.model_dir))
        log.info("engine: %s; %d inference sessions; batching %s (max %d requests, %d tokens, "
                 "delay %g ms); queue bound %d", self.sessions[0].engine.describe(),
                 len(self.sessions), cfg.batching, self.policy.cap, cfg.max_batch_tokens,
                 cfg.max_queue_delay_ms, cfg.max_queue)
        if cfg.batching == "auto":
            log.info("batch cost model after warm-up (ms per batch, ROWSxLENGTH): %s",
                     self.policy.cost.table() if self.policy.cost else {})
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
        conn = Connection(sock, peer, self)
        with self._lock:
            self.connections.add(conn)
        self.stats.on_connection(True)
        conn.thread.start()

    def admit(self, request: QARequest, respond: Responder, alive: Any) -> None:
        """Tokenize one request and queue it. Raises BadRequest or ShuttingDown for it alone."""
        if self._draining:
            raise ShuttingDown("server is shutting down; request not admitted")
        assert self.task is not None
        features = self.task.preprocess(request.question, request.context)
        admitted = time.monotonic()
        stats = self.stats

        def respond_and_count(result: dict[str, Any] | None, error: ServerError | None) -> None:
            respond(result, error)
            stats.on_finished("ok" if error is None else error.code, time.monotonic() - admitted)

        stats.on_admitted()
        try:
            self.queue.put(WorkItem(features=features, respond=respond_and_count, alive=alive,
                                    rows=features.rows, length=features.max_len,
                                    enqueued_at=admitted))
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
        """True while every session has its engine loaded and the server is not draining."""
        loaded = bool(self.sessions) and all(s.engine is not None for s in self.sessions)
        return loaded and not self._draining

    def stats_result(self) -> dict[str, Any]:
        """Counters and timings, plus what is being served and how: the ``stats`` op's result."""
        result = self.stats.snapshot()
        result["queue_depth"] = len(self.queue)
        result["ready"] = self.ready
        result["config"] = {k: v for k, v in asdict(self.config).items() if v is not None}
        if self.info is not None:
            result["model"] = {"name": self.info.model_name, "source": self.info.source,
                               "meaningful": self.info.meaningful}
        result["batching"] = {"mode": self.config.batching, "max_batch_size": self.policy.cap,
                              "max_batch_tokens": self.config.max_batch_tokens,
                              "cost_model_ms": self.policy.cost.table() if self.policy.cost else {}}
        engine = self.sessions[0].engine if self.sessions else None
        if engine is not None:
            result["engine"] = {"type": engine.name, "device": engine.device,
                                "description": engine.describe()}
        return result

    def forget(self, conn: Connection) -> None:
        """Drop a closed connection from the registry."""
        with self._lock:
            self.connections.discard(conn)
        self.stats.on_connection(False)

    # -- stop --------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop accepting, refuse new requests, answer every admitted one, close, join.

        Returns:
            True if every session drained within ``timeout`` (default: the configured one).
        """
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        if self._listener is not None:
            self._listener.stop()  # first stop accepting, then refuse new requests
        self._draining = True
        self.queue.close()
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        for session in self.sessions:
            session.join(left())
        drained = not any(s.is_alive() for s in self.sessions)
        with self._lock:
            connections = list(self.connections)
        for conn in connections:
            conn.close()
        for conn in connections:
            conn.thread.join(left())
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        log.info("stopped (%s)", "all admitted requests answered" if drained else "timed out")
        return drained

    def __enter__(self) -> InferenceServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    """Command-line options -> ServerConfig."""
    d = ServerConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=d.host, help="address to bind (0.0.0.0: all interfaces)")
    p.add_argument("--port", type=int, default=d.port, help="TCP port (0: any free port)")
    p.add_argument("--num_inference_sessions", type=int, default=d.num_inference_sessions,
                   help="inference-session threads, each with its own engine")
    p.add_argument("--inference_engine_type", choices=ENGINE_TYPES, default=d.inference_engine_type)
    p.add_argument("--model_dir", default=d.model_dir, help="folder written by prepare_model.py")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N (auto: GPU if any)")
    p.add_argument("--threads_per_session", type=int, default=d.threads_per_session,
                   help="CPU threads per engine (0: cores divided among sessions)")
    p.add_argument("--batching", choices=BATCHING_MODES, default=d.batching,
                   help="auto: batch only as far as the measured cost says it pays; fixed: fill "
                        "up to the caps; off: one request per batch")
    p.add_argument("--max_batch_size", type=int, default=d.max_batch_size,
                   help="most requests a session runs as one batch")
    p.add_argument("--max_batch_tokens", type=int, default=d.max_batch_tokens,
                   help="most rows x padded length in one batch (a larger request runs alone)")
    p.add_argument("--max_queue_delay_ms", type=float, default=d.max_queue_delay_ms,
                   help="most a request waits for a bigger batch (only spent when it can help)")
    p.add_argument("--batch_lookahead", type=int, default=d.batch_lookahead,
                   help="waiting requests considered when forming a batch")
    p.add_argument("--max_queue", type=int, default=d.max_queue, help="bound of the shared queue")
    p.add_argument("--max_frame_size", type=int, default=d.max_frame_size, help="frame cap, bytes")
    p.add_argument("--send_timeout", dest="send_timeout_s", type=float, default=d.send_timeout_s,
                   help="seconds a reply may block on a client that does not read")
    p.add_argument("--no_answer", choices=["auto", "on", "off"], default=d.no_answer,
                   help="SQuAD2 'no answer' (auto: on for SQuAD2 models)")
    p.add_argument("--max_seq_len", type=int, default=d.max_seq_len)
    p.add_argument("--doc_stride", type=int, default=d.doc_stride)
    p.add_argument("--max_answer_len", type=int, default=d.max_answer_len)
    p.add_argument("--shutdown_timeout", dest="shutdown_timeout_s", type=float,
                   default=d.shutdown_timeout_s, help="seconds to finish admitted work on stop")
    p.add_argument("--metrics_port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    p.add_argument("--metrics_host", default=d.metrics_host, help="address for --metrics_port")
    p.add_argument("--log_level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = vars(p.parse_args(argv))
    logging.basicConfig(level=args.pop("log_level"),
                        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    return ServerConfig(**args)


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
    except (ModelDirError, RuntimeError, OSError) as exc:
        log.error("cannot start: %s", exc)
        server.shutdown(timeout=5)
        return 2
    stop.wait()
    return 0 if server.shutdown() else 1


if __name__ == "__main__":
    sys.exit(main())
