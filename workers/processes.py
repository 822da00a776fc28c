"""``--workers N``: N worker processes behind the front end's one shared queue.

The front end (server.py's process) only frames, validates and queues requests. A dispatcher
thread hands the oldest queued requests to the worker with the fewest in hand, and only to a
worker holding fewer than its ``window``: a busy worker is never handed more while another is
idle, and what no worker can take yet waits in the front end's queue, where deadlines and the
overload cap apply as with one process. Each worker tokenizes, batches (cost-aware, its own
cost model), runs its sessions and post-processes; answers come back in bulk on its pipe.

A worker that dies (SIGKILL, a crash) is noticed when its pipe closes: every request it held is
answered with ``worker_lost`` at once, and it is restarted (with a growing back-off while
restarts keep failing to load) while the others keep serving. The queue sits behind ``Backend``
(workers/backend.py); a networked broker implements the same.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any

from engines.model_dir import ModelInfo
from protocol.errors import ShuttingDown, WorkerLost, error_for_code
from protocol.messages import ModelRequest
from scheduling.queue import DeadlineReaper, Responder, WorkItem, WorkQueue
from scheduling.waits import StartCancelled, wait_until_set
from settings.server_config import ServerConfig
from telemetry.stats import ServerStats
from transport.coalesce import coalesced_sends
from workers import pipe_items as pipe
from workers.executors import ExecutorSet
from workers.handle import WorkerHandle
from workers.launch import exit_words, spawn, wait_exit
from workers.stats_answers import new_token

log = logging.getLogger(__name__)

#: Seconds to wait for a worker whose pipe closed to report its exit status.
EXIT_WAIT_S = 1.0


class ProcessBackend:
    """Worker processes, one per entry of ``config.worker_devices()``.

    Args:
        config: Serving settings (each worker runs ``num_inference_sessions`` sessions).
        info: The prepared model's metadata.
        stats: The front end's statistics (worker restarts are counted here).
        log_level: The workers' logging level.
    """

    def __init__(self, config: ServerConfig, info: ModelInfo, stats: ServerStats,
                 log_level: int = logging.INFO) -> None:
        self.config = config
        self.info = info
        self.stats = stats
        self.log_level = log_level
        self.model = Path(config.model_dir).name  # names the model in log lines (a repository)
        self.queue = WorkQueue(config.max_queue)
        #: Most requests one worker holds at once: one batch running, the next one forming.
        self.window = config.worker_window()
        self.handles = [WorkerHandle(i, device) for i, device in
                        enumerate(config.worker_devices())]
        #: --executors on: each device's engine in a process of its own, fed by every worker
        self.executors = ExecutorSet(config, [h.device for h in self.handles], stats,
                                     log_level) if config.executors == "on" else None
        self._cond = threading.Condition()  # guards the handles' state and jobs
        self._ids = itertools.count()
        self._reaper = DeadlineReaper(self.queue)
        self._pump_lock = threading.Lock()  # one thread hands out work at a time
        self._pump_wanted = False
        self._timers: list[threading.Timer] = []
        self._started = False
        self._stopping = False
        self._answering = 0  # bulks popped from jobs whose replies are still being written

    # -- start -------------------------------------------------------------------------------
    def start(self, cancel: threading.Event | None = None) -> None:
        """Start every worker and wait until each has loaded and warmed up.

        Args:
            cancel: Give up once this is set (a stop asked during start-up): every worker is
                told to stop, and exits at once, loaded or not (workers/worker_main.py).

        Raises:
            RuntimeError: a worker could not start (the server cannot start).
            StartCancelled: ``cancel`` was set before every worker was ready.
        """
        try:
            if self.executors is not None:
                self.executors.start(cancel)  # before the workers, whose engines reach them
            for handle in self.handles:
                self._spawn(handle)
            for handle in self.handles:
                wait_until_set(handle.loaded, cancel)  # the main thread: signals are handled
        except (StartCancelled, RuntimeError):
            self._abandon_start()
            raise
        with self._cond:  # one that loaded may have died while the others were loading
            failed = next((h for h in self.handles if h.load_error is not None
                           or h.state != "serving"), None)
        if failed is not None:
            self._abandon_start()
            raise RuntimeError(f"worker {failed.index} could not start: "
                               f"{failed.load_error or 'it died while the others loaded'}")
        self._started = True
        self._reaper.start()

    def _abandon_start(self) -> None:
        """Stop every worker of a start that cannot go on; none holds any work yet."""
        with self._cond:
            self._stopping = True
        self.queue.close()
        self._stop_workers(time.monotonic())
        if self.executors is not None:
            self.executors.stop(5.0)

    def _spawn(self, handle: WorkerHandle) -> None:
        """Start a (new) process for ``handle``, and the thread that reads its pipe.

        A fresh interpreter (``python -m workers.worker_main``), not a fork of this threaded
        process, and not multiprocessing's spawn, which would re-run the user's main module.
        """
        executor = self.executors.routes_for(handle.device) if self.executors else None
        process, ours = spawn("workers.worker_main", pipe.WorkerStart(
            self.config, handle.index, handle.device, self.log_level, executor))
        with self._cond:
            if self._stopping:  # stop() ran while this process started: it would be orphaned
                process.kill()
                ours.close()
                wait_exit(process, 5.0)
                return
            handle.attach(process, ours)
        threading.Thread(target=self._receive, args=(handle, process, ours), daemon=True,
                         name=f"worker-{handle.index}-pipe").start()

    # -- what the server calls -----------------------------------------------------------------
    def submit(self, request: ModelRequest, respond: Responder, alive: Any,
               enqueued_at: float, deadline: float | None) -> None:
        """Queue one request for the next worker with room (it is tokenized there).

        Raises:
            ShuttingDown: the queue is closed.
            Overloaded: the queue is full.
        """
        self.queue.put(WorkItem(features=request, respond=respond, alive=alive,
                                enqueued_at=enqueued_at, deadline=deadline))

    @property
    def ready(self) -> bool:
        """True while every worker is loaded, warmed up and serving."""
        with self._cond:
            return self._started and not self._stopping and \
                all(h.state == "serving" for h in self.handles)

    @property
    def queue_depth(self) -> int:
        """Requests waiting in the front end for a worker with room."""
        return len(self.queue)

    def purge(self, drop: Any) -> list[WorkItem]:
        """Remove and return the front end's queued items for which ``drop`` is true."""
        return self.queue.purge(drop)

    def describe(self) -> dict[str, Any]:
        """The first serving worker's engine and batching figures, and each worker process's
        resident memory when it was ready (``workers_mb``)."""
        with self._cond:
            out = next((dict(h.describe) for h in self.handles if h.describe), {})
            out["workers_mb"] = [h.describe.get("process_mb") if h.describe else None
                                 for h in self.handles]
        return out

    # -- dispatch ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand queued requests to workers with room now (the reader calls this once per read,
        so a pipelined burst travels to a worker as one message)."""
        self._pump()

    def _pump(self) -> None:
        """Dispatch on whichever thread asks (a reader after admitting, a pipe thread after
        answers freed room, a worker becoming ready): no dispatcher thread to wake per request.
        A thread that finds another pumping leaves it a note to go round once more."""
        self._pump_wanted = True
        while self._pump_wanted and self._pump_lock.acquire(blocking=False):
            try:
                self._pump_wanted = False
                while self._dispatch_once():
                    pass
            finally:
                self._pump_lock.release()

    def _room(self) -> int:
        return sum(max(0, self.window - len(h.jobs)) for h in self.handles
                   if h.state == "serving")

    def _dispatch_once(self) -> bool:
        """Move what fits from the queue to the workers; True if anything moved."""
        with self._cond:  # taken and recorded in one hold: never out of both queue and jobs
            room = 0 if self._stopping else self._room()
            items = self.queue.take_upto(room, block=False) if room else []
            shares = self._assign(items) if items else {}
        for handle, jobs in shares.items():
            handle.send(pipe.Jobs(jobs))  # a worker that died meanwhile: its pipe thread answers
        return bool(items)

    def _assign(self, items: list[WorkItem]) -> dict[WorkerHandle, list[pipe.Job]]:
        """Give each item to the serving worker holding fewest (``_cond`` held); return each
        worker's share, to be sent once the lock is released."""
        shares: dict[WorkerHandle, list[pipe.Job]] = {}
        open_handles = [h for h in self.handles if h.state == "serving"]
        for item in items:
            if not item.alive():  # its client left while it waited
                item.drop()
                continue
            # there is one: no more items were taken than the room counted in this hold
            handle = min((h for h in open_handles if len(h.jobs) < self.window),
                         key=lambda h: len(h.jobs))
            job_id = next(self._ids)
            handle.jobs[job_id] = item
            shares.setdefault(handle, []).append(
                pipe.Job(job_id, item.features, item.enqueued_at, item.deadline))
        return shares

    # -- a worker's pipe -----------------------------------------------------------------------
    def _receive(self, handle: WorkerHandle, process: Any, conn: Any) -> None:
        """Read one worker process's messages until its pipe closes, then account for it."""
        try:
            while True:
                match conn.recv():
                    case pipe.Answers(answers):
                        self._answered(handle, answers)
                    case pipe.Ready(describe):
                        self._on_ready(handle, process, describe)
                    case pipe.Stats(token, figures):
                        handle.answers.answer(token, figures)
                    case pipe.Failed(message):
                        handle.load_error = message
        except (EOFError, OSError):
            pass
        wait_exit(process, EXIT_WAIT_S)  # for its exit status; a pipe closes only as a worker ends
        if process.poll() is None:
            process.kill()
            wait_exit(process, EXIT_WAIT_S)
        self._lost(handle, process)

    def _on_ready(self, handle: WorkerHandle, process: Any, describe: dict[str, Any]) -> None:
        """The worker loaded and warmed up: it takes work from now on."""
        with self._cond:
            handle.on_ready(describe)
            self._cond.notify_all()
        self._pump()
        log.debug("model %s: worker %d (pid %d) serving on %s", self.model, handle.index,
                 process.pid, handle.describe.get("engine", {}).get("device", handle.device))

    def _answered(self, handle: WorkerHandle, answers: list[pipe.Answer]) -> None:
        with self._cond:
            done = [(handle.jobs.pop(job_id, None), result, code, message)
                    for job_id, result, code, message in answers]
            self._answering += 1
        try:
            self._pump()  # the room just freed
            with coalesced_sends():  # one write per connection for the whole bulk
                for item, result, code, message in done:
                    if item is not None:
                        item.answer(result, None if code is None else
                                    error_for_code(code, message, request_id=None))
        finally:
            with self._cond:
                self._answering -= 1
                self._cond.notify_all()  # progress for a draining stop

    def _lost(self, handle: WorkerHandle, process: Any) -> None:
        """A worker process ended: answer what it held; unless stopping, restart it."""
        with self._cond:
            if handle.process is not process:
                return
            orphans, was_serving = handle.detach()  # its figures move to the slot's earlier ones
            self._cond.notify_all()
        how = exit_words(process.returncode)
        if not handle.loaded.is_set():  # it ended while loading
            handle.load_error = handle.load_error or f"worker process {how} while loading"
            handle.loaded.set()
        if orphans:
            error = WorkerLost(f"worker {handle.index} (pid {process.pid}) {how} holding this "
                               "request; it is being restarted; the request may be sent again")
            for item in orphans:
                item.answer(None, error)
        if self._stopping or not self._started:
            return
        self._restart(handle, was_serving, how, len(orphans))

    def _restart(self, handle: WorkerHandle, was_serving: bool, how: str, orphans: int) -> None:
        delay = handle.restarts.next_delay(served=was_serving)
        self.stats.count_event("worker_restart")
        log.error("model %s: worker %d %s (%d requests answered worker_lost); restarting it "
                  "in %g s (restart #%d)", self.model, handle.index, how, orphans, delay,
                  handle.restarts.count)
        timer = threading.Timer(delay, self._respawn, args=(handle,))
        timer.name, timer.daemon = f"restart-worker-{handle.index}", True
        self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()

    def _respawn(self, handle: WorkerHandle) -> None:
        if self._stopping:
            return
        try:
            self._spawn(handle)
        except OSError as exc:  # no process could be started (limits, memory): try again later
            self._restart(handle, False, f"could not be started again ({exc})", 0)

    # -- figures -------------------------------------------------------------------------------
    def summed(self, stats: ServerStats, figures: list[dict[str, Any]]) -> ServerStats:
        """The front end's ``stats`` plus every worker's batch figures (``worker_figures``;
        a worker's last answer when it gave none in time) and those of the processes each
        slot had before (read with them, so that a process that dies meanwhile counts once:
        summed counters never go backwards when a worker is replaced)."""
        merged = stats.copy()
        known = [w["known_figures"] for w in figures if w["known_figures"] is not None]
        earlier = [w["earlier_figures"] for w in figures]
        for source in [*earlier, *known]:
            merged.absorb(source, share=1 / max(1, len(known)))
        return merged

    def worker_figures(self, timeout: float = 2.0) -> list[dict[str, Any]]:
        """Each worker's state and, where it answers within ``timeout``, its batch figures."""
        token = new_token()  # as the executors' queries take theirs
        for handle in self.handles:
            if handle.state == "serving":
                handle.answers.expect(token)
                handle.send(pipe.AskStats(token))
        until = time.monotonic() + timeout
        return [handle.figures(token, until) for handle in self.handles]

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, timeout: float) -> bool:
        """Refuse new work; let the workers finish what was admitted; stop them.

        What is still queued or held when ``timeout`` runs out is answered ``shutting_down``.

        Returns:
            True if every admitted request was answered in time.
        """
        until = time.monotonic() + timeout
        self.queue.close()
        while True:
            self._pump()  # what still waits goes to the workers as they free room
            with self._cond:
                drained = not len(self.queue) and not any(h.jobs for h in self.handles) \
                    and not self._answering
                if drained or time.monotonic() >= until:
                    self._stopping = True
                    self._cond.notify_all()
                    break
                self._cond.wait(0.05)
        for timer in self._timers:
            timer.cancel()
        if not drained:
            self._give_up()
        self._stop_workers(until)
        if self.executors is not None:  # after the workers: their last batches ran on them
            self.executors.stop(max(5.0, until - time.monotonic()))
        with self._cond:  # replies popped before the stop must be written before connections finish
            self._cond.wait_for(lambda: not self._answering, max(1.0, until - time.monotonic()))
        if self._reaper.is_alive():
            self._reaper.join(1.0)
        return drained

    def _give_up(self) -> None:
        """Answer everything still queued or held with ``shutting_down``."""
        stopped = ShuttingDown("server stopped before this request could run")
        with self._cond:
            held = [item for h in self.handles for item in h.jobs.values()]
            for handle in self.handles:
                handle.jobs.clear()
        for item in held + self.queue.purge(lambda item: True):
            item.answer(None, stopped)

    def _stop_workers(self, until: float) -> None:
        """Tell every worker to stop, wait for each (at least a few seconds), kill stragglers."""
        for handle in self.handles:
            handle.send(pipe.Stop())
        for handle in self.handles:
            if handle.process is not None:
                wait_exit(handle.process, max(5.0, until - time.monotonic()))
                if handle.process.poll() is None:
                    log.warning("model %s: worker %d did not exit; killing it", self.model,
                                handle.index)
                    handle.process.kill()
                    wait_exit(handle.process, 5.0)
