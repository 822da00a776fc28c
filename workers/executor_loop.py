"""An executor's run loop (``--executors on``): the rows of every worker's jobs in, batches
through the device's one engine, each job's outputs back once all its rows have run.

A job's groups (workers/executor_wire.py: one padded length each) wait as pieces of rows. The
loop plans each batch over the waiting pieces as a GPU session plans over requests
(scheduling/planner.py with ``fill``), then, where the engine pads rows up to steps (CUDA
graphs), fills the step the batch runs at anyway with rows of pieces left out, no longer than
the batch: a piece may be split, its remainder waiting at its place in the queue. So a batch of
30 rows on a graph of 32 takes 2 more rows where any are waiting, and a worker's job of 15 rows
may run across two batches. A job whose deadline passes before all its rows have run is
answered ``deadline_exceeded`` and its rows left out, as are the rows of a job whose batch
failed: the device runs no row whose answer nobody takes.

Two threads: the run loop (plan, pad, run) and the reply thread (cut each batch's outputs back
into its pieces, and answer each job once its last piece has run), so that the device's next
batch is planned and started while the last one's answers are cut and sent. Where nothing
waits, the loop answers itself: a lone job's answer wakes no other thread.

With ``overlap`` on an engine that overlaps (``Engine.overlaps``: PyTorch's CUDA graphs, the
simulated device), the loop only launches each batch: while the device runs batch N, the loop
plans batch N+1 and copies its inputs in behind it, and the reply thread waits for N's outputs,
then cuts and sends them. At most ``IN_FLIGHT`` batches are launched and not yet taken. The
planning, the padding, the token budget and the deadlines are the same either way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

import numpy as np

from engines.base import IN_FLIGHT, Engine
from scheduling.planner import BatchPolicy, plan_batch
from workers.executor_jobs import JobState, Link, Piece, Ran, fill_step, group_rows
from workers.executor_wire import Failure, Job, pad_columns

log = logging.getLogger("executor")


class Executor:
    """The run loop and the reply thread over one engine (see the module docstring)."""

    def __init__(self, engine: Engine, policy: BatchPolicy, per_token: bool,
                 overlap: bool = False) -> None:
        self.engine, self.policy, self.per_token = engine, policy, per_token
        self.overlap = overlap and engine.overlaps
        self._in_flight = threading.BoundedSemaphore(IN_FLIGHT)  # launched, not yet taken
        self._untaken = 0  # launches whose result is not taken yet (under _cond)
        self._pieces: list[Piece] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._ran: SimpleQueue[Ran | None] = SimpleQueue()
        self._replying = threading.Lock()  # one thread cuts and answers a batch at a time
        self.counts = {"batches": 0, "rows": 0, "jobs": 0, "expired_jobs": 0,
                       "shared_batches": 0, "most_processes_in_a_batch": 0}
        self.engine_s = 0.0  # wall seconds in the engine's runs
        self.idle_s = 0.0  # seconds the loop waited with nothing to run
        self._threads = [threading.Thread(target=_or_exit(self._loop), name="run-loop",
                                          daemon=True),
                         threading.Thread(target=_or_exit(self._replies), name="replies",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def figures(self) -> dict[str, Any]:
        """Batches, rows and jobs run, jobs failed for their deadline, batches holding rows of
        several worker processes, the most processes in one, pieces waiting now, the seconds in
        the engine (launch to result, where batches overlap) and idle, whether batches overlap,
        and the device's busy share where the engine knows it."""
        with self._cond:
            waiting = len(self._pieces)
        out = {**self.counts, "pieces_waiting": waiting, "engine_s": round(self.engine_s, 3),
               "idle_s": round(self.idle_s, 3), "overlapping": self.overlap}
        busy = self.engine.device_busy()
        return out if busy is None else {**out, "device_busy": busy}

    def submit(self, link: Link, job: Job) -> None:
        """Queue a job's groups for the coming batches."""
        state = JobState(link, job)
        if state.left == 0:  # a session never sends one: nothing to run, nothing to answer with
            state.fail("engine_error", "a job of no rows")
            return
        pieces = [Piece(state, number, 0, group_rows(group), next(iter(group.values())).shape[1],
                        state.arrived) for number, group in enumerate(job.groups) if group_rows(group)]
        with self._cond:
            self._pieces.extend(pieces)
            self._cond.notify()

    def stop(self, timeout: float) -> None:
        """Run what is queued, answer it, then end both threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                if self.overlap:  # planned once the device has room: as full as it can be
                    self._in_flight.acquire()
                chosen = self._next_batch()
                if not chosen:  # every piece waiting was unwanted
                    if self.overlap:
                        self._in_flight.release()
                    continue
                self._hand_over(self._launch(chosen) if self.overlap else self._run(chosen))
        finally:
            self._ran.put(None)

    def _wait_for_work(self) -> bool:
        """Wait until pieces wait (True), or the executor stops with none left (False)."""
        with self._cond:
            if not self._pieces and not self._stopping:
                waited = time.monotonic()
                self._cond.wait_for(lambda: bool(self._pieces) or self._stopping)
                self.idle_s += time.monotonic() - waited
            return bool(self._pieces)

    def _next_batch(self) -> list[Piece]:
        """The next batch's pieces, once the unwanted ones are out of the queue (their
        ``deadline_exceeded`` answers sent, with the queue open to connections); empty where
        none is left."""
        with self._cond:
            expired = self._drop_unwanted()
            chosen = self._plan() if self._pieces else []
        for state, failure in expired:
            state.link.send(failure)
        return chosen

    def _hand_over(self, ran: Ran) -> None:
        """Answer ``ran`` on this thread where nothing else waits (no piece to plan, no batch
        being cut): a lone job's answer then wakes no reply thread. Else the reply thread
        cuts and sends it while the next batch runs."""
        with self._cond:  # results are taken in order: a launch alone only if no other waits
            alone = not self._pieces and not self._stopping and (
                ran.pending is None or self._untaken == 1)
        if alone and self._ran.empty() and self._replying.acquire(blocking=False):
            try:
                self._reply(ran)
            finally:
                self._replying.release()
            return
        self._ran.put(ran)

    def _drop_unwanted(self) -> list[tuple[JobState, Failure]]:
        """Out of the queue: the pieces of jobs answered already (a batch holding some of their
        rows failed), of jobs whose worker is gone, and of jobs whose deadline has passed
        (returned with their ``deadline_exceeded`` answers, to send), so that the device runs
        no row whose answer nobody takes."""
        now, expired = time.monotonic(), []
        for piece in self._pieces:
            state = piece.state
            if state.link.closed:
                state.abandon()
            elif (failure := state.expire(now)) is not None:
                expired.append((state, failure))
        self.counts["expired_jobs"] += len(expired)
        self._pieces = [piece for piece in self._pieces if not piece.state.answered]
        return expired

    def _plan(self) -> list[Piece]:
        """The next batch's pieces, out of the queue (a split piece's rest stays in it)."""
        window = self._pieces[:self.policy.lookahead]
        chosen = fill_step(plan_batch(window, self.policy), window, self.policy)
        taken = set(map(id, chosen))
        self._pieces = [piece for piece in self._pieces if id(piece) not in taken]
        return chosen

    def _feeds(self, chosen: list[Piece]) -> tuple[dict[str, np.ndarray], int, int]:
        """The batch's inputs (its pieces' rows, padded to its longest), its rows and length."""
        length = max(piece.length for piece in chosen)
        feeds = {name: np.concatenate([pad_columns(piece.feed(name), length)
                                       for piece in chosen])
                 for name in self.engine.input_names}
        return feeds, sum(piece.rows for piece in chosen), length

    def _run(self, chosen: list[Piece]) -> Ran:
        """One batch: its pieces, outputs (or the error), device seconds and start."""
        started = time.monotonic()
        try:
            feeds, rows, length = self._feeds(chosen)
            outputs: Any = self.engine.run(feeds)
        except Exception as exc:  # noqa: BLE001 - the batch's jobs fail, the loop goes on
            log.exception("a batch of %d pieces failed", len(chosen))
            return Ran(chosen, exc, 0.0, started)
        seconds = self._account(chosen, rows, length, time.monotonic() - started,
                                self.engine.device_s)
        return Ran(chosen, outputs, seconds, started)

    def _launch(self, chosen: list[Piece]) -> Ran:
        """One batch launched on an overlapping engine: its result is taken by ``_reply``."""
        started = time.monotonic()
        try:
            feeds, _, _ = self._feeds(chosen)
            launched = self.engine.launch(feeds)
            with self._cond:
                self._untaken += 1
            return Ran(chosen, None, 0.0, started, launched)
        except Exception as exc:  # noqa: BLE001 - the batch's jobs fail, the loop goes on
            self._in_flight.release()
            log.exception("launching a batch of %d pieces failed", len(chosen))
            return Ran(chosen, exc, 0.0, started)

    def _take(self, ran: Ran) -> Ran:
        """A launched batch's outputs (or the error), once the device has run it."""
        chosen, _, _, started, launched = ran
        assert launched is not None
        try:
            outputs: Any = launched.result()
        except Exception as exc:  # noqa: BLE001 - the batch's jobs fail, the loop goes on
            log.exception("a batch of %d pieces failed", len(chosen))
            return Ran(chosen, exc, 0.0, started)
        finally:
            with self._cond:
                self._untaken -= 1
            self._in_flight.release()
        length = max(piece.length for piece in chosen)
        rows = sum(piece.rows for piece in chosen)
        seconds = self._account(chosen, rows, length, time.monotonic() - started,
                                launched.device_s)
        return Ran(chosen, outputs, seconds, started)

    def _account(self, chosen: list[Piece], rows: int, length: int, wall: float,
                 device_s: float | None) -> float:
        """Count a batch that ran, teach the cost model its cost; returns that cost."""
        seconds = wall if device_s is None else device_s  # the device's time where known
        if self.policy.cost is not None:
            self.policy.cost.observe(rows, length, seconds)
        self.engine_s += wall
        sources = len({piece.state.link.source for piece in chosen})
        counts = self.counts
        counts["batches"] += 1
        counts["rows"] += rows
        counts["shared_batches"] += sources > 1
        counts["most_processes_in_a_batch"] = max(counts["most_processes_in_a_batch"], sources)
        return seconds

    def _replies(self) -> None:
        """The reply thread: each batch the loop hands over, cut and answered."""
        while (ran := self._ran.get()) is not None:
            with self._replying:
                self._reply(ran)

    def _reply(self, ran: Ran) -> None:
        """Cut a batch's outputs into its pieces; answer the jobs they complete (or fail its
        jobs, where it failed)."""
        if ran.pending is not None:
            ran = self._take(ran)
        chosen, outputs, seconds, started, _ = ran
        if not isinstance(outputs, Exception):
            try:
                self._answer(chosen, outputs, seconds, started)
                return
            except Exception as exc:  # noqa: BLE001 - outputs it cannot cut: they fail
                log.exception("cutting a batch's outputs failed")
                outputs = exc
        for piece in chosen:  # answered already: no second answer
            piece.state.fail("engine_error", f"{type(outputs).__name__}: {outputs}")

    def _answer(self, chosen: list[Piece], outputs: dict[str, np.ndarray], seconds: float,
                started: float) -> None:
        """Each piece its rows of ``outputs``; the jobs they complete answered."""
        rows, first = sum(piece.rows for piece in chosen), 0
        for piece in chosen:
            part = slice(first, first + piece.rows)
            first += piece.rows
            mine = {name: (value[part, :piece.length] if self.per_token else value[part])
                    for name, value in outputs.items()}
            if piece.state.add(piece.group, piece.first, mine, seconds * piece.rows / rows,
                               started):
                self.counts["jobs"] += 1


def _or_exit(body: Callable[[], None]) -> Callable[[], None]:
    """``body``, ending the process should anything escape it: a thread of the executor
    gone would leave jobs unanswered while the process lives on, where its exit fails them
    (the workers see the connection close) and the front end starts a new executor."""
    def guarded() -> None:
        try:
            body()
        except BaseException:  # noqa: BLE001 - said, then the process ends
            log.critical("the executor's %s thread failed: exiting",
                         threading.current_thread().name, exc_info=True)
            logging.shutdown()
            os._exit(1)
    return guarded
