"""Inference-session threads: each owns one engine and serves batches from the shared queue."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from engines.base import Engine
from protocol.errors import DeadlineExceeded, EngineError, InternalError, ServerError
from scheduling.planner import MIN_GAIN, BatchPolicy
from scheduling.queue import WorkItem, WorkQueue
from tasks.base import answer_of
from telemetry.stats import ServerStats
from transport.coalesce import coalesced_sends

log = logging.getLogger(__name__)

#: Runs of each warm-up shape; the fastest counts.
WARMUP_RUNS = 3
#: Times a warm-up shape is timed again while a bigger batch of its length times cheaper.
WARMUP_RETIMES = 2


class BatchTask(Protocol):
    """What a session needs of a task (tasks/base.py's Task has it)."""

    def collate(self, batch: Sequence[Any]) -> dict[str, Any]: ...

    def split_outputs(self, batch: Sequence[Any], outputs: Any) -> list[tuple[Any, ...]]: ...

    def postprocess(self, features: Any, *outputs: Any) -> dict[str, Any]: ...


class InferenceSession(threading.Thread):
    """One worker thread with its own engine.

    The engine is created inside the thread (``engine_factory``), so loading N sessions runs in
    parallel and each engine is only ever touched by its own thread. The engine then runs each
    warm-up shape (timed into the policy's cost model: the engine's device time where it reports
    one, else the wall time) and ``ready`` is set; ``load_error``
    holds the exception if loading or warming up failed.

    Args:
        index: Session number, used in the thread name and logs.
        engine_factory: Builds this session's engine.
        task: Turns features into engine inputs and engine outputs into answers.
        queue: The shared work queue.
        policy: How batches are formed; an int means "up to that many, in arrival order". With
            a device-bound engine (a GPU, ``Engine.device_bound``) the session serves it with
            ``fill`` set: batches fill up to the caps whenever requests wait (a request of
            another length joins only where the cost model says that pays).
        stats: Where batch sizes, queue waits and engine times are recorded.
        warmup: Padded lengths to warm up and time before reporting ready (see ``warm_up``).
        prime: Batch shapes (rows, padded length) to run once each, untimed, before reporting
            ready, so that engines that build per shape (TensorRT) have built for them.
        on_exit: Called (from this thread) if the session stops for any reason other than the
            queue closing: its engine failed to load, or an exception escaped the serving loop.
            ``crash`` then holds that exception.
        model: The served model's name, for the log (None: the log names no model).
        release_engine: Hands the engine back when the session ends (default: closes it); an
            engine shared by the model's sessions (engines/sharing.py) closes with its last.

    A queue closed while the session loads (a stop asked during start-up) cuts the warm-up
    short: the session then closes its engine and ends without serving.
    """

    def __init__(self, index: int, engine_factory: Callable[[], Engine], task: BatchTask,
                 queue: WorkQueue, policy: BatchPolicy | int = 1,
                 stats: ServerStats | None = None,
                 warmup: Sequence[int] = (), prime: Sequence[tuple[int, int]] = (),
                 on_exit: Callable[[InferenceSession], None] | None = None,
                 model: str | None = None,
                 release_engine: Callable[[Engine], None] | None = None) -> None:
        super().__init__(name=f"session-{index}", daemon=True)
        self.index = index
        self.model = model
        self.engine_factory = engine_factory
        self.release_engine = release_engine or _close
        self.task = task
        self.queue = queue
        self.policy = policy if isinstance(policy, BatchPolicy) else \
            BatchPolicy(mode="fixed", max_items=policy, lookahead=policy)
        self.warmup_lengths = list(warmup)
        self.prime_shapes = list(prime)
        self.stats = stats if stats is not None else ServerStats()
        self.engine: Engine | None = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.crash: BaseException | None = None
        self.on_exit = on_exit
        self.batches_run = 0

    @property
    def serving(self) -> bool:
        """Loaded, warmed up and taking batches."""
        return self.ready.is_set() and self.load_error is None and self.crash is None \
            and self.is_alive()

    def run(self) -> None:
        """Load the engine, then serve batches until the queue is closed and drained."""
        try:
            self.engine = self.engine_factory()
            if self.engine.device_bound and not self.policy.fill:
                self.policy = replace(self.policy, fill=True)  # a GPU: batches fill the caps
            if self.policy.cost is not None and self.engine.row_steps:  # CUDA graphs' shapes
                self.policy.cost.set_steps(self.engine.row_steps, self.engine.length_steps)
            self.warm_up(self.engine)
        except BaseException as exc:  # noqa: BLE001 - reported to the server
            self.load_error = exc
            self._release_quietly()
            self.ready.set()
            if self.on_exit is not None:
                self.on_exit(self)
            return
        self.ready.set()
        if self.queue.closed_and_empty:  # stopped while it loaded: nothing to serve
            self._release_quietly()
            return
        log.debug("%s%s: engine loaded and warmed up; serving",
                 "" if self.model is None else f"model {self.model}: ", self.name)
        try:
            self._serve()
        finally:
            self._release_quietly()
        if self.crash is not None and self.on_exit is not None:
            self.on_exit(self)

    def _serve(self) -> None:
        """Run batches until the queue is drained; if anything escapes, record it in ``crash``
        and fail the unanswered requests of the batch in hand."""
        batch: list[WorkItem] = []
        try:
            while batch := self.queue.take_batch(self.policy):
                try:
                    self.run_batch(batch)
                finally:
                    self.queue.done()
        except BaseException as exc:  # noqa: BLE001 - the pool replaces a session that dies
            self.crash = exc  # before any reply: from now on this session is not serving
            log.critical("%s died: %s: %s", self.name, type(exc).__name__, exc, exc_info=True)
            error = InternalError(f"inference session died: {type(exc).__name__}")
            for item in batch:
                item.answer(None, error)  # only those not answered yet

    def warm_up(self, engine: Engine) -> None:
        """Run and time the shapes batching will use, before the server reports ready.

        For each warm-up length, rows double from 1 while the time per row keeps falling by at
        least MIN_GAIN (and within the policy's caps): where batching does not pay this stops at
        2 rows, where it pays it goes up to the cap. Each shape runs several times; the fastest
        (free of a first run's allocations and of noise, which only add) goes into the cost
        model, a smaller shape timed dearer than a bigger one being timed again
        (``time_shapes``).
        """
        outputs = engine.run(dummy_feeds(engine.input_names, 1, 16))  # first run allocates
        check = getattr(self.task, "check_outputs", None)  # optional in the task contract
        if check is not None:  # a model its task cannot read fails here, not every request
            check(outputs, 1)
        for rows, length in self.prime_shapes:
            if self.queue.closed_and_empty:  # stopped while loading: warm up for nothing
                return
            engine.run(dummy_feeds(engine.input_names, rows, length))
        time_shapes(engine, self.policy, self.warmup_lengths,
                    lambda: self.queue.closed_and_empty)

    def _release_quietly(self) -> None:
        """Hand the engine back (``release_engine``), logging rather than raising a failure."""
        try:
            if self.engine is not None:
                self.release_engine(self.engine)
        except Exception:  # noqa: BLE001 - closing a broken engine must not mask why it broke
            log.exception("closing the engine failed")

    def run_batch(self, batch: list[WorkItem]) -> None:
        """Run one batch; every item gets exactly one response, errors scoped to this batch."""
        taken = time.monotonic()
        live = []
        for item in batch:
            if not item.alive():
                item.drop()  # its client left: dropped before the engine
            elif item.expired(taken):
                item.answer(None, item.deadline_error(taken))
            else:
                live.append(item)
        if not live:
            return
        assert self.engine is not None
        features = [item.features for item in live]
        try:
            feeds = self.task.collate(features)
            started = time.monotonic()
            outputs = self.engine.run_by(feeds, _latest_deadline(live))
            engine_s = time.monotonic() - started
            per_request = self.task.split_outputs(features, outputs)
        except ServerError as exc:  # typed by the engine (an executor's): said as it is
            _fail_typed(live, exc, self.name)
            return
        except Exception as exc:  # noqa: BLE001 - the batch fails, the session keeps serving
            log.exception("%s: engine failed on a batch of %d", self.name, len(live))
            error = EngineError(f"inference failed: {type(exc).__name__}: {exc}")
            for item in live:
                item.answer(None, error)
            return
        self.batches_run += 1
        rows, length = next(iter(feeds.values())).shape
        if self.policy.cost is not None:
            self.policy.cost.observe(rows, length, batch_cost(self.engine, engine_s))
        self.stats.on_batch(len(live), rows, [taken - i.enqueued_at for i in live], engine_s)
        with coalesced_sends():  # one write per connection for the batch's replies
            for item, outputs in zip(live, per_request):
                self._answer(item, outputs)

    def _answer(self, item: WorkItem, outputs: tuple[Any, ...]) -> None:
        item.answer(*answer_of(self.task, item.features, outputs, self.name))


def _latest_deadline(items: Sequence[WorkItem]) -> float | None:
    """When the last of ``items`` stops wanting an answer (None: one of them never does)."""
    latest = 0.0
    for item in items:
        if item.deadline is None:
            return None
        latest = max(latest, item.deadline)
    return latest


def _fail_typed(items: Sequence[WorkItem], error: ServerError, session: str) -> None:
    """Answer ``items`` with the engine's typed ``error``, in its words (which say whether the
    rows ran); a deadline only at debug level in the log: under overload it is the rule."""
    level = logging.DEBUG if isinstance(error, DeadlineExceeded) else logging.WARNING
    log.log(level, "%s: a batch of %d failed: %s: %s", session, len(items), error.code,
            error.message)
    for item in items:
        item.answer(None, error)


def time_shapes(engine: Engine, policy: BatchPolicy, lengths: Sequence[int],
                stopped: Callable[[], bool] = lambda: False) -> None:
    """Time the batch shapes batching will use, into ``policy``'s cost model (warm-up): at
    each length, rows double from 1 while the time per row keeps falling by at least MIN_GAIN,
    within the policy's caps. Each shape runs WARMUP_RUNS times and the fastest counts (a first
    run's allocations and noise only add). A smaller batch timed dearer than a bigger one ran
    while the machine was busy (other processes warming up): it is timed again, up to
    WARMUP_RETIMES times. Ends early once ``stopped()``."""
    for length in lengths:
        timed = _time_length(engine, policy, length, stopped)
        if policy.cost is not None:
            for rows, seconds in timed.items():
                policy.cost.observe(rows, length, seconds, warmup=True)


def _time_length(engine: Engine, policy: BatchPolicy, length: int,
                 stopped: Callable[[], bool]) -> dict[int, float]:
    """{rows: seconds} of the shapes timed at ``length`` (see ``time_shapes``)."""
    cap, budget = policy.cap, policy.max_tokens
    timed: dict[int, float] = {}
    rows = 1
    while rows <= cap and (not budget or rows * length <= budget or rows == 1) and not stopped():
        timed[rows] = _fastest(engine, rows, length)
        for _ in range(WARMUP_RETIMES):
            undercut = [r for r in timed if r < rows and timed[r] > timed[rows]]
            for smaller in undercut:
                timed[smaller] = min(timed[smaller], _fastest(engine, smaller, length))
            if not undercut:
                break
        best = min((timed[r] / r for r in timed if r < rows), default=float("inf"))
        if timed[rows] / rows > best * (1 - MIN_GAIN):
            break  # bigger batches stopped paying clearly at this length
        rows *= 2
    return timed


def _fastest(engine: Engine, rows: int, length: int) -> float:
    """The least cost of WARMUP_RUNS runs of a batch of ``rows`` x ``length``."""
    feeds = dummy_feeds(engine.input_names, rows, length)
    seconds = float("inf")
    for _ in range(WARMUP_RUNS):
        started = time.monotonic()
        engine.run(feeds)
        seconds = min(seconds, batch_cost(engine, time.monotonic() - started))
    return seconds


def batch_cost(engine: Engine, wall_s: float) -> float:
    """What a batch cost, for the cost model: the device time the engine measured for its last
    run where it has one (the wall time also counts the host's waits, for the GIL say, which
    would make big batches look dear), else ``wall_s``."""
    return wall_s if engine.device_s is None else engine.device_s


def _close(engine: Engine) -> None:
    engine.close()


def dummy_feeds(input_names: Sequence[str], rows: int, length: int) -> dict[str, np.ndarray]:
    """Engine inputs of a given shape for warm-up: every token real, one segment."""
    shape = (rows, length)
    values = {"input_ids": np.full(shape, 1000, dtype=np.int64),
              "attention_mask": np.ones(shape, dtype=np.int64),
              "token_type_ids": np.zeros(shape, dtype=np.int64)}
    return {name: values.get(name, np.zeros(shape, dtype=np.int64)) for name in input_names}
