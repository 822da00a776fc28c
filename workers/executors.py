"""``--executors on``: one executor process per device, started by the front end before the
workers and stopped after them; one that dies is restarted (workers/executor_main.py).

The workers reach each executor at a Unix socket in a folder of the front end's own, with a key
made for this server: each worker is given its device's address and the key in its first
message (workers/processes.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import Connection

from scheduling.waits import Restarts, wait_until_set
from settings.server_config import ServerConfig
from telemetry.stats import ServerStats
from workers.executor_client import executor_address
from workers.executor_wire import ExecutorRoutes
from workers.launch import exit_words, spawn, wait_exit
from workers.pipe_items import AskStats, ExecutorStart, Failed, Ready, Stats, Stop
from workers.stats_answers import StatsAnswers, new_token

log = logging.getLogger(__name__)


class ExecutorHandle:
    """One device's executor as the front end sees it: its process, pipe and state."""

    def __init__(self, device: str, address: str) -> None:
        self.device, self.address = device, address
        self.process: subprocess.Popen[bytes] | None = None
        self.control: Connection | None = None
        self.ready = threading.Event()
        self.description = ""
        self.error: str | None = None
        self.restarts = Restarts()  # its replacements (scheduling/waits.py's policy)
        self.send_lock = threading.Lock()  # stats and stop come from different threads
        self.answers = StatsAnswers()  # each stats query's own, by its token


class ExecutorSet:
    """The executors of ``devices``, one each.

    Args:
        config: Serving settings (the engine the executors load).
        devices: The devices, one executor each (duplicates share one).
        stats: Where executor restarts are counted (``executor_restart``).
        log_level: The executors' logging level.
    """

    def __init__(self, config: ServerConfig, devices: list[str], stats: ServerStats,
                 log_level: int = logging.INFO) -> None:
        self.config, self.stats, self.log_level = config, stats, log_level
        self.folder = tempfile.mkdtemp(prefix="qa-executors-")
        self.authkey = os.urandom(16)
        self.handles = {device: ExecutorHandle(device, executor_address(self.folder, device))
                        for device in dict.fromkeys(devices)}
        self._lock = threading.Lock()
        self._stopping = False

    def routes_for(self, device: str) -> ExecutorRoutes:
        """Where a worker on ``device`` reaches the executors: every one, its device's first."""
        others = [(h.device, h.address) for h in self.handles.values() if h.device != device]
        mine = [(device, self.handles[device].address)] if device in self.handles else []
        return ExecutorRoutes(tuple(mine + others), self.authkey)

    def start(self, cancel: threading.Event | None = None) -> None:
        """Start every executor and wait until each has loaded its engine.

        Raises:
            RuntimeError: one could not start.
            StartCancelled: ``cancel`` was set first.
        """
        for handle in self.handles.values():
            self._spawn(handle)
        for handle in self.handles.values():
            wait_until_set(handle.ready, cancel)
            if handle.error is not None:
                raise RuntimeError(f"the executor of {handle.device} could not start: "
                                   f"{handle.error}")

    def describe(self) -> list[dict[str, object]]:
        """Each executor: device, pid, state, restarts, what it runs."""
        with self._lock:
            return [{"device": h.device, "pid": h.process.pid if h.process else None,
                     "state": "serving" if h.ready.is_set() and h.error is None else "starting",
                     "restarts": h.restarts.count, "description": h.description}
                    for h in self.handles.values()]

    def figures(self, timeout: float = 2.0) -> list[dict[str, object]]:
        """``describe`` with each executor's batch figures (workers/executor_loop.py's
        ``Executor.figures``), asked now; the last ones of an executor that did not answer
        within ``timeout`` (``answered_stats`` False)."""
        token, asked = new_token(), []
        for handle in self.handles.values():
            handle.answers.expect(token)
            if _send(handle, AskStats(token)):
                asked.append(handle)
        deadline = time.monotonic() + timeout
        answers = {handle.device: handle.answers.wait(token, deadline) if handle in asked
                   else None for handle in self.handles.values()}
        return [{**entry, **(answers[handle.device] or handle.answers.last or {}),
                 "answered_stats": answers[handle.device] is not None}
                for entry, handle in zip(self.describe(), self.handles.values(), strict=True)]

    def stop(self, timeout: float) -> None:
        """Tell every executor to stop (the workers have drained), wait, then kill what is
        left; remove the sockets' folder."""
        with self._lock:
            self._stopping = True
            handles = list(self.handles.values())
        for handle in handles:
            _send(handle, Stop())
        deadline = time.monotonic() + timeout
        for handle in handles:
            if handle.process is not None:
                wait_exit(handle.process, max(0.1, deadline - time.monotonic()))
                if handle.process.poll() is None:
                    log.warning("the executor of %s did not stop in time: killed", handle.device)
                    handle.process.kill()
                    wait_exit(handle.process, 5.0)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _spawn(self, handle: ExecutorHandle) -> None:
        """A (new) process for ``handle``, and the thread that watches it."""
        process, control = spawn("workers.executor_main", ExecutorStart(
            self.config, handle.device, handle.address, self.authkey, self.log_level))
        with self._lock:
            if self._stopping:
                process.kill()
                control.close()
                return
            handle.process, handle.control = process, control
        threading.Thread(target=self._watch, args=(handle, process, control), daemon=True,
                         name=f"executor-{handle.device}").start()

    def _watch(self, handle: ExecutorHandle, process: subprocess.Popen[bytes],
               control: Connection) -> None:
        """Read the executor's pipe; when it closes, restart the executor unless stopping."""
        try:
            while True:
                match control.recv():
                    case Ready(description):
                        handle.description, handle.error = description, None
                        handle.ready.set()
                    case Failed(message):
                        handle.error = message
                        handle.ready.set()
                    case Stats(token, figures):
                        handle.answers.answer(token, figures)
        except (EOFError, OSError):
            pass
        handle.answers.cancel()  # a query awaiting this process stops waiting
        wait_exit(process, 1.0)
        with self._lock:
            served = handle.ready.is_set() and handle.error is None
            if self._stopping or (not served and handle.restarts.count == 0):
                return  # stopping, or its first start failed: start() reports that
            handle.ready.clear()
            backoff = handle.restarts.next_delay(served)
        self.stats.count_event("executor_restart")
        log.warning("the executor of %s %s%s; its workers' batches in hand fail with "
                    "worker_lost; restarting it in %.1f s", handle.device,
                    exit_words(process.returncode), "" if served else " while starting again",
                    backoff)
        time.sleep(backoff)
        self._spawn(handle)


def _send(handle: ExecutorHandle, message: AskStats | Stop) -> bool:
    """Send on the executor's pipe; False where it is gone (or not started)."""
    with handle.send_lock:
        if handle.control is None:
            return False
        try:
            handle.control.send(message)
            return True
        except OSError:
            return False
