"""The body of one worker process: a LocalBackend fed through its end of a pipe.

The front end starts it as ``python -m workers.worker_main FD``. Messages on the pipe
(workers/pipe_items.py's named types), front end -> worker:

    WorkerStart(config, index, device, log_level, executor)   first, once
    Jobs([Job(job_id, request, enqueued_at, deadline), ...])   (request: protocol.messages)
    AskStats(token)             Stop()

and worker -> front end:

    Ready(describe)             Failed(message)             Stats(token, batch_figures)
    Answers([Answer(job_id, result or None, error code or None, error message or None), ...])

Times are ``time.monotonic()`` seconds, one clock for every process of a machine. The worker
tokenizes each job as it arrives (on the thread that reads the pipe, while its sessions run the
engine), batches and runs them as the in-process server does, and sends answers back in bulk.

Its main thread loads the model while the ``pipe-reader`` thread already reads the pipe, so
that the worker hears the front end at any time. It ignores SIGINT and SIGTERM (and runs in a
session of its own, workers/launch.py): the front end alone stops it. Told to stop, it drains
and exits; told to stop while it still loads, or finding the front end's end of the pipe closed
(the front end died), it exits at once: it holds no work yet, or nobody awaits its answers.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from engines import GIL_RETAKING
from engines.model_dir import load_model_info
from protocol.errors import InternalError, ServerError
from settings.server_config import ServerConfig, configure_logging
from tasks.encoding import release_gil
from telemetry.stats import ServerStats
from transport.bulk import BulkSender
from workers.cpu_policy import apply_cpu_scheduling
from workers.executor_client import LINK_TIMES, ExecutorEngine
from workers.executor_wire import ExecutorRoutes
from workers.launch import serve_child
from workers.local import LocalBackend
from workers.pipe_items import (
    Answer,
    Answers,
    AskStats,
    Failed,
    Job,
    Jobs,
    Ready,
    Stats,
    Stop,
    WorkerStart,
)

log = logging.getLogger("worker")


class Outbox:
    """Answers (and the other messages) from every thread, sent back in bulk by one thread
    (transport/bulk.py): while a send is under way, the next answers gather into the next
    ``Answers``. A session's batch of answers goes on the session's own thread where nothing
    else is on its way and no work waits for a session (``serve``): no wake-up of the sending
    thread for a lone request. The thread that reads the pipe never writes to it, so neither
    side can block the other's reading."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._bulk: BulkSender[Answer | Ready | Failed | Stats] = BulkSender(self._send, "outbox")
        self._bulk.start()

    def answer(self, job_id: int, result: dict[str, Any] | None,
               error: ServerError | None) -> None:
        """Queue one answer (any thread; never blocks on the pipe)."""
        self._bulk.put(Answer(job_id, result, None, None) if error is None else
                       Answer(job_id, None, error.code, error.message))

    def serve(self, backend: LocalBackend) -> None:
        """Sessions may send their own answers while ``backend``'s queue is empty."""
        self._bulk.idle = lambda: backend.queue_depth == 0

    def post(self, message: Ready | Failed | Stats) -> None:
        """Queue one other message, sent after the answers queued before it."""
        self._bulk.put(message)

    def _send(self, bulk: list[Answer | Ready | Failed | Stats]) -> bool:
        """The bulk's answers as one message, then the others; False: the front end is gone."""
        answers = [item for item in bulk if isinstance(item, Answer)]
        others = [item for item in bulk if not isinstance(item, Answer)]
        try:
            for message in ([Answers(answers)] if answers else []) + others:
                self.conn.send(message)
        except OSError:  # nobody to answer
            return False
        return True

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._bulk.close(10)


def run_worker(config: ServerConfig, index: int, device: str, conn: Connection,
               log_level: int = logging.INFO,
               executor: ExecutorRoutes | None = None) -> int:
    """Entry point of worker process ``index`` (started by workers.processes.ProcessBackend):
    load, serve until told to stop or orphaned, stop. Returns the exit status (0; 1 if the
    model could not be loaded)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end drains, then stops us itself
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level, f"worker-{index}")
    scheduling = apply_cpu_scheduling(config.cpu_scheduling)  # before our threads: they inherit
    log.debug("CPU scheduling: %s", scheduling)
    stats = ServerStats()
    # One thread tokenizes here. Holding the GIL through its encodes saves hand-offs with the
    # session thread, unless the engine takes the GIL back more than once per run (PyTorch,
    # engines.GIL_RETAKING): then each take-back would wait behind a whole encode.
    release_gil(config.inference_engine_type in GIL_RETAKING)
    outbox = Outbox(conn)
    reader = PipeReader(conn, outbox, stats)
    reader.start()  # from now on a stop, or the front end's end, while we load exits at once
    try:
        info = load_model_info(config.model_dir)
        # its queue holds whatever the front end may hand it: admission was the front end's
        local = replace(config, workers=1, max_queue=max(config.max_queue, config.worker_window()))
        factory = None if executor is None else partial(
            ExecutorEngine, config.model_dir, executor,
            config.bucket_lengths())  # the executors, its device's first
        backend = LocalBackend(local, info, stats, device=device, engine_factory=factory)
        backend.start()
    except Exception as exc:  # noqa: BLE001 - reported to the front end, which exits
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        outbox.post(Failed(f"{type(exc).__name__}: {exc}"))
        outbox.close()
        return 1
    reader.serve(backend)
    outbox.serve(backend)
    outbox.post(Ready(backend.describe()))
    reader.join()
    backend.stop(0.0 if reader.orphaned else config.shutdown_timeout_s)
    outbox.close()
    return 0


class PipeReader(threading.Thread):
    """Reads the front end's messages from the worker's start to its end.

    Before ``serve`` (the model still loads) the front end sends nothing but ``stop``: told to
    stop, or finding the pipe closed, the process exits at once (its main thread may be deep in
    an engine's load, which cannot be interrupted; nothing was admitted). Once serving, jobs are
    tokenized and queued here, and the thread ends when told to stop or when the pipe closes
    (``orphaned``), for the main thread to stop the backend.
    """

    def __init__(self, conn: Connection, outbox: Outbox, stats: ServerStats) -> None:
        super().__init__(name="pipe-reader", daemon=True)
        self.conn, self.outbox, self.stats = conn, outbox, stats
        self.backend: LocalBackend | None = None
        self.orphaned = True  # until the front end says stop: its end of the pipe may just close
        self._lock = threading.Lock()

    def serve(self, backend: LocalBackend) -> None:
        """The model is loaded: from now on, jobs go to ``backend``, and a stop drains it."""
        with self._lock:
            self.backend = backend

    def run(self) -> None:
        """Read messages until told to stop or the pipe closes; see the class for what a stop
        does while the model still loads (the process exits from here)."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._end("front end gone", orphaned=True)
                return
            if isinstance(message, Stop):
                self._end("told to stop", orphaned=False)
                return
            backend = self.backend  # set before Ready went out: jobs come after it
            assert backend is not None, f"{type(message).__name__} before ready"
            match message:
                case Jobs(jobs):
                    for job in jobs:
                        _submit(backend, self.outbox, job)
                case AskStats(token):
                    self.outbox.post(Stats(token, self._figures(backend)))

    def _figures(self, backend: LocalBackend) -> dict[str, Any]:
        """This worker's batch figures, queue, device and executor link, for the front end."""
        figures = self.stats.batch_figures()
        figures["queue_depth"] = backend.queue_depth
        figures["device_busy"] = backend.device_busy()
        figures["executor_link"] = LINK_TIMES.to_raw()  # None without executors
        return figures

    def _end(self, why: str, orphaned: bool) -> None:
        """Leave the serving to the main thread's stop; or, still loading, exit now."""
        with self._lock:
            loading = self.backend is None
            self.orphaned = orphaned
        level = logging.WARNING if orphaned else logging.DEBUG
        if loading:
            log.log(level, "%s while loading the model; exiting", why)
            logging.shutdown()
            os._exit(0)
        log.log(level, "%s; stopping", why)


def _submit(backend: LocalBackend, outbox: Outbox, job: Job) -> None:
    """Tokenize and queue one job; a job that cannot be admitted is answered at once."""
    job_id, request, enqueued_at, deadline = job

    def respond(result: dict[str, Any] | None, error: ServerError | None) -> None:
        outbox.answer(job_id, result, error)

    try:
        backend.submit(request, respond, _always, enqueued_at, deadline)
    except ServerError as exc:
        outbox.answer(job_id, None, exc)
    except Exception as exc:  # noqa: BLE001 - one bad request fails alone
        log.exception("unexpected error admitting a job")
        outbox.answer(job_id, None, InternalError(f"{type(exc).__name__}: {exc}"))


def _always() -> bool:
    return True


def main(conn: Connection, first: WorkerStart) -> int:
    """``python -m workers.worker_main FD`` (workers/launch.py's ``serve_child``): FD is this
    worker's end of the front end's pipe, whose first message is a ``WorkerStart`` (its
    ``executor``: the executors' ``ExecutorRoutes`` with ``--executors on``, else None)."""
    return run_worker(first.config, first.index, first.device, conn, first.log_level,
                      first.executor)


if __name__ == "__main__":
    serve_child(sys.argv, main)
