"""Inference-session threads: each owns one engine and serves batches from the shared queue."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from engines.base import Engine
from engines.batching import WorkItem, WorkQueue
from protocol.errors import EngineError, InternalError, ServerError
from telemetry.stats import ServerStats

log = logging.getLogger(__name__)


class BatchTask(Protocol):
    """What a session needs from a task (engines.qa.QATask satisfies it)."""

    def collate(self, batch: Sequence[Any]) -> dict[str, Any]: ...

    def split_outputs(self, batch: Sequence[Any], outputs: Any) -> list[tuple[Any, Any]]: ...

    def postprocess(self, features: Any, start_logits: Any, end_logits: Any) -> dict[str, Any]: ...


class InferenceSession(threading.Thread):
    """One worker thread with its own engine.

    The engine is created inside the thread (``engine_factory``), so loading N sessions runs in
    parallel and each engine is only ever touched by its own thread. ``ready`` is set once the
    engine is loaded; ``load_error`` holds the exception if loading failed.

    Args:
        index: Session number, used in the thread name and logs.
        engine_factory: Builds this session's engine.
        task: Turns features into engine inputs and engine outputs into answers.
        queue: The shared work queue.
        max_batch_size: Most requests run together as one batch.
        stats: Where batch sizes, queue waits and engine times are recorded.
    """

    def __init__(self, index: int, engine_factory: Callable[[], Engine], task: BatchTask,
                 queue: WorkQueue, max_batch_size: int = 1,
                 stats: ServerStats | None = None) -> None:
        super().__init__(name=f"session-{index}", daemon=True)
        self.index = index
        self.engine_factory = engine_factory
        self.task = task
        self.queue = queue
        self.max_batch_size = max_batch_size
        self.stats = stats if stats is not None else ServerStats()
        self.engine: Engine | None = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.batches_run = 0

    def run(self) -> None:
        """Load the engine, then serve batches until the queue is closed and drained."""
        try:
            self.engine = self.engine_factory()
        except BaseException as exc:  # noqa: BLE001 - reported to the server, which exits
            self.load_error = exc
            return
        finally:
            self.ready.set()
        try:
            while batch := self.queue.take_batch(self.max_batch_size):
                self.run_batch(batch)
        finally:
            self.engine.close()

    def run_batch(self, batch: list[WorkItem]) -> None:
        """Run one batch; every item gets exactly one response, errors scoped to this batch."""
        taken = time.monotonic()
        live = [item for item in batch if item.alive()]
        for _ in range(len(batch) - len(live)):
            self.stats.on_finished("client_gone", None)  # dropped before the engine
        if not live:
            return
        assert self.engine is not None
        features = [item.features for item in live]
        try:
            feeds = self.task.collate(features)
            started = time.monotonic()
            outputs = self.engine.run(feeds)
            engine_s = time.monotonic() - started
            per_request = self.task.split_outputs(features, outputs)
        except Exception as exc:  # noqa: BLE001 - the batch fails, the session keeps serving
            log.exception("%s: engine failed on a batch of %d", self.name, len(live))
            error = EngineError(f"inference failed: {type(exc).__name__}: {exc}")
            for item in live:
                _respond(item, None, error)
            return
        self.batches_run += 1
        rows = len(next(iter(feeds.values())))
        self.stats.on_batch(len(live), rows, [taken - i.enqueued_at for i in live], engine_s)
        for item, (start, end) in zip(live, per_request):
            self._answer(item, start, end)

    def _answer(self, item: WorkItem, start: Any, end: Any) -> None:
        try:
            result = self.task.postprocess(item.features, start, end)
        except Exception as exc:  # noqa: BLE001 - one bad answer fails alone
            log.exception("%s: postprocessing failed", self.name)
            _respond(item, None, InternalError(f"postprocessing failed: {type(exc).__name__}"))
            return
        _respond(item, result, None)


def _respond(item: WorkItem, result: dict[str, Any] | None, error: ServerError | None) -> None:
    """Call the item's responder; a failing responder (dead socket) never hurts the session."""
    try:
        item.respond(result, error)
    except Exception:  # noqa: BLE001
        log.exception("responder failed")
