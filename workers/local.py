"""Serving in one process: the model's task, a shared queue, N session threads and the deadline
reaper. ``--workers 1`` serves this way inside the server's own process; with ``--workers N``
each worker process runs one of these behind its pipe (workers/worker_main.py)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from engines import load_engine
from engines.base import Engine
from engines.model_dir import ModelInfo
from engines.sharing import SharedEngines
from engines.sim_device import SimSettings
from protocol.errors import ShuttingDown
from protocol.messages import ModelRequest
from scheduling.cost_model import CostModel
from scheduling.idle import IdleRelease
from scheduling.planner import BatchPolicy
from scheduling.pool import SessionPool
from scheduling.queue import DeadlineReaper, Responder, WorkItem, WorkQueue
from scheduling.session import BatchTask, InferenceSession
from scheduling.waits import StartCancelled
from settings.server_config import ServerConfig
from tasks import load_task
from tasks.base import Task
from tasks.encoding import releases_gil
from tasks.qa_answers import numpy_search_reason, span_search
from telemetry.memory import process_memory, resident_mb, trim_heap
from telemetry.stats import ServerStats

log = logging.getLogger(__name__)


def batch_policy(config: ServerConfig) -> BatchPolicy:
    """How a free session forms its next batch, from the settings (with a fresh cost model)."""
    return BatchPolicy(mode=config.batching, max_items=config.max_batch_size,
                       max_tokens=config.max_batch_tokens,
                       max_delay_s=config.max_queue_delay_ms / 1000,
                       lookahead=config.batch_lookahead, cost=CostModel())


def prime_shapes(buckets: tuple[int, ...], max_batch_tokens: int) -> list[tuple[int, int]]:
    """Batch shapes every session runs before ready when there are length buckets: one row of
    each bucket, and as many rows as the token budget allows at the shortest and the longest
    bucket, so that an engine that builds for the range of shapes it has seen (TensorRT) has
    built for every batch within the budget."""
    shapes = [(1, length) for length in buckets]
    if buckets and max_batch_tokens:
        shapes += [(max(1, max_batch_tokens // n), n) for n in dict.fromkeys((buckets[0],
                                                                                buckets[-1]))]
    return shapes


def describe_serving(policy: BatchPolicy, engine: Engine | None) -> dict[str, Any]:
    """The batching figures and (once loaded) the engine of a set of sessions, for stats and
    the start-up log (dispatch/serving_log.py):
    ``max_batch_size``, ``cost_model_ms`` and ``engine`` (type, device, precision, words,
    whether batches fill up to the caps on it (``device_bound``), whether the process's
    encodes release the GIL, and what it holds on its GPU (``device_mb``) where it knows)."""
    out: dict[str, Any] = {"cost_model_ms": policy.cost.table() if policy.cost else {},
                           "max_batch_size": policy.cap}
    if engine is not None:
        out["engine"] = {"type": engine.name, "device": engine.device,
                         "precision": engine.precision, "description": engine.describe(),
                         "device_bound": engine.device_bound,
                         "encodes_release_gil": releases_gil(), **engine.memory_figures()}
    return out


def default_engine_factory(config: ServerConfig, device: str,
                           queue: WorkQueue | None = None) -> Callable[[], Engine]:
    """Builds one session's engine as the settings say (threads, precision, device, and the
    shapes a PyTorch engine captures CUDA graphs for: length buckets, longest length, token
    budget); ``queue`` (ONNX on the CPU) says when a batch has the machine to itself."""
    return partial(load_engine, config.inference_engine_type, config.model_dir, device=device,
                   threads=config.engine_threads(), lone_threads=config.lone_threads(),
                   crowded=None if queue is None else queue.crowded, precision=config.precision,
                   graph=config.pytorch_graph, lengths=config.bucket_lengths(),
                   max_seq_len=config.max_seq_len, max_tokens=config.max_batch_tokens,
                   onnx_cuda_graphs=config.onnx_cuda_graphs == "on",
                   sim=SimSettings(curve=config.sim_cost_curve, scale=config.sim_scale,
                                   host=config.sim_host == "on",
                                   directory=config.sim_device_dir))


def model_label(config: ServerConfig) -> str:
    """The served model's name, for log lines: its folder's name (a repository's subfolder)."""
    folder = Path(config.model_dir)
    return folder.name or folder.resolve().name


def session_pool(config: ServerConfig, engines: SharedEngines, task: BatchTask,
                 queue: WorkQueue, policy: BatchPolicy, stats: ServerStats,
                 buckets: tuple[int, ...], longest: int) -> SessionPool:
    """``--num_inference_sessions`` sessions on ``queue``, as a pool not started yet: its
    ``start`` returns once every one has loaded (or shares, ``engines``), primed and (the
    first) timed its engine for the cost model."""
    # two lengths, a short one and the longest: the cost model scales between them, and
    # start-up stays short (each length times doubling row counts while batching pays);
    # with length buckets, every bucket: the only lengths batches will have
    warmup = list(buckets) or sorted({n for n in (64,) if n < longest} | {longest})
    model = model_label(config)

    def make(index: int, initial: bool) -> InferenceSession:
        # One session times the warm-up shapes for the shared cost model (sessions warming
        # at once would time each other's contention); every session primes its engine.
        timed = config.batching == "auto" and index == 0 and initial
        return InferenceSession(index, engines.acquire, task, queue, policy, stats,
                                warmup=warmup if timed else (),
                                prime=prime_shapes(buckets, config.max_batch_tokens), model=model,
                                release_engine=engines.release)

    return SessionPool(config.num_inference_sessions, make,
                       on_restart=lambda: stats.count_event("session_restart"))


class LocalBackend:
    """Tokenizes requests (by the model's task) as they are submitted and runs them on
    ``num_inference_sessions`` threads, each with its own engine.

    Args:
        config: Serving settings.
        info: The prepared model's metadata.
        stats: Where batch figures and session restarts are counted.
        device: The engines' device (default: ``config.device``).
        engine_factory: Builds each session's engine (default: ``load_engine`` per the config).
    """

    def __init__(self, config: ServerConfig, info: ModelInfo, stats: ServerStats,
                 device: str | None = None,
                 engine_factory: Callable[[], Engine] | None = None) -> None:
        self.config = config
        self.info = info
        self.stats = stats
        self.device = device or config.device
        self.queue = WorkQueue(config.max_queue)
        self.engines = SharedEngines(engine_factory or default_engine_factory(
            config, self.device, self.queue))
        self.policy = batch_policy(config)
        self.task: Task | None = None
        self.pool: SessionPool | None = None
        self._reaper = DeadlineReaper(self.queue)
        self._idle = IdleRelease(self.queue, self.release_memory)
        self.memory_mb: float | None = None  # what loading the model added to the process

    def start(self, cancel: threading.Event | None = None) -> None:
        """Load the task (its tokenizer), then every session's engine (warmed up), then serve.

        Args:
            cancel: Give up once this is set (a stop asked during start-up); ``stop`` then
                waits for the sessions still loading.

        Raises:
            RuntimeError: a session could not load its engine.
            StartCancelled: ``cancel`` was set before every session was ready.
        """
        before = resident_mb()
        self.task = load_task(self.config.model_dir, self.info, self.config)
        reason = numpy_search_reason()
        if self.info.task == "qa" and reason is not None:
            log.warning("QA answers are searched in numpy: the C span search is %s (same "
                        "answers, more CPU per request; docs/operations.md)", reason)
        self._start_sessions(self.task, cancel)
        self.release_memory()  # what warm-up's largest batch took
        after = resident_mb()
        if before is not None and after is not None:
            self.memory_mb = round(max(0.0, after - before), 1)
        self._reaper.start()
        self._idle.start()

    def release_memory(self) -> None:
        """Give back the working memory of past batches: each distinct engine's, then the
        C heap's (also done by the idle watcher after a spell without work)."""
        if self.pool is not None:
            self.pool.release_memory()
        trim_heap()

    def _start_sessions(self, task: Task, cancel: threading.Event | None) -> None:
        self.pool = session_pool(self.config, self.engines, task, self.queue,
                                 self.policy, self.stats, task.buckets, task.max_seq_len)
        try:
            self.pool.start(cancel)
        except (RuntimeError, StartCancelled):
            self.queue.close()  # the sessions still loading end once loaded; stop joins them
            raise

    def submit(self, request: ModelRequest, respond: Responder, alive: Callable[[], bool],
               enqueued_at: float, deadline: float | None) -> None:
        """Tokenize one request and queue it; ``respond`` is called once when it is answered.

        Raises:
            BadRequest: text the model cannot take.
            ShuttingDown: the queue is closed.
            Overloaded: the queue is full (checked before the cost of tokenizing, and again).
        """
        if self.task is None:
            raise ShuttingDown("not serving yet")
        self.queue.check_room()
        features = self.task.features(request)
        self.queue.put(WorkItem(features=features, respond=respond, alive=alive,
                                rows=features.rows,
                                length=self.task.padded_length(features.max_len),
                                enqueued_at=enqueued_at, deadline=deadline))

    def flush(self) -> None:
        """Nothing to do: sessions take from the queue as work arrives."""

    @property
    def ready(self) -> bool:
        """True while every session is loaded, warmed up and serving."""
        return self.pool is not None and self.pool.serving

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a session."""
        return len(self.queue)

    @property
    def engine(self) -> Engine | None:
        """A serving session's engine, for describing what is served."""
        return self.pool.engine if self.pool is not None else None

    def device_busy(self) -> float | None:
        """The engine's device's busy fraction of late, where the engine knows it."""
        engine = self.engine
        return engine.device_busy() if engine is not None else None

    def purge(self, drop: Callable[[WorkItem], bool]) -> list[WorkItem]:
        """Remove and return the queued items for which ``drop`` is true (unanswered)."""
        return self.queue.purge(drop)

    def worker_figures(self) -> list[dict[str, Any]]:
        """This process as worker 0: state, pid, device, requests held, session restarts and
        its batch figures (the shape ProcessBackend.worker_figures gives per process)."""
        figures = self.stats.batch_figures()
        figures["queue_depth"] = self.queue_depth
        figures["device_busy"] = self.device_busy()
        engine = self.describe().get("engine", {})
        return [{"worker": 0, "pid": os.getpid(), "device": engine.get("device", self.device),
                 "state": "serving" if self.ready else "starting",
                 "in_flight": self.stats.in_flight,
                 "restarts": figures["events"].get("session_restart", 0), "figures": figures,
                 "known_figures": figures}]

    def summed(self, stats: ServerStats, figures: list[dict[str, Any]]) -> ServerStats:
        """Nothing to add: every figure is already in this process's ``stats``."""
        return stats

    def describe(self) -> dict[str, Any]:
        """The engine, device and batching figures, for stats and logs; for a QA model, which
        span search this process decodes answers with (``engine.span_search``: c or numpy)."""
        out = describe_serving(self.policy, self.engine)
        if self.info.task == "qa" and "engine" in out:
            out["engine"]["span_search"] = span_search()
        out["memory_mb"] = self.memory_mb
        out["process_mb"] = process_memory()["rss_mb"]
        out["engines"] = 1 if self.engines.shared is not None else \
            self.config.num_inference_sessions
        return out

    def stop(self, timeout: float) -> bool:
        """Refuse new work, let the sessions drain what was admitted, and stop them.

        Work still queued when ``timeout`` runs out is answered with ``shutting_down``.

        Returns:
            True if every admitted request was run in time.
        """
        self.queue.close()
        drained = self.pool.join(timeout) if self.pool is not None else True
        if not drained:
            stopped = ShuttingDown("server stopped before this request could run")
            for item in self.queue.purge(lambda item: True):
                item.answer(None, stopped)
        if self._reaper.is_alive():
            self._reaper.join(1.0)
        self._idle.stop()
        return drained
