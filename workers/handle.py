"""The front end's record of one worker process: its pipe, state and the requests it holds."""

from __future__ import annotations

import threading
from typing import Any

from scheduling.queue import WorkItem
from scheduling.waits import Restarts
from telemetry.stats import ServerStats
from workers.stats_answers import StatsAnswers

#: A worker's states: loading its model, taking work, or gone (being restarted, or stopped).
STATES = ("starting", "serving", "lost")


class WorkerHandle:
    """One worker slot; its process is replaced when it dies. The fields below the pipe are
    guarded by the owning ProcessBackend's lock, except ``send``, which locks itself.

    Args:
        index: The worker's number (0-based), stable across restarts.
        device: Where its engines run ("cpu", "cuda:1", ...).
    """

    def __init__(self, index: int, device: str) -> None:
        self.index = index
        self.device = device
        self.process: Any = None
        self.conn: Any = None
        self.state = "starting"
        self.jobs: dict[int, WorkItem] = {}  # sent to the worker, not answered yet
        self.describe: dict[str, Any] = {}  # what its ready message said
        self.loaded = threading.Event()  # it reported ready, or failed to
        self.load_error: str | None = None
        self.restarts = Restarts()  # the slot's replacements (scheduling/waits.py's policy)
        self._send_lock = threading.Lock()
        #: Stats queries awaiting this process, by token; its cond guards the figures below.
        self.answers = StatsAnswers()
        self.last_figures: dict[str, Any] | None = None  # the newest answer of this process
        #: The batch figures of this slot's earlier processes, as each last reported them.
        self.earlier = ServerStats()

    def attach(self, process: Any, conn: Any) -> None:
        """A new process for this slot: starting, holding nothing."""
        self.process, self.conn = process, conn
        self.state, self.load_error = "starting", None
        self.loaded.clear()

    def on_ready(self, describe: dict[str, Any]) -> None:
        """The process loaded and warmed up its engines."""
        self.describe = describe
        self.state = "serving"
        self.loaded.set()

    def detach(self) -> tuple[list[WorkItem], bool]:
        """The process ended: return the requests it held and whether it had been serving.

        Its newest figures (an answer to a query not yet read counts: its pipe thread read it
        before the end) move to ``earlier``; this slot's next process starts from none, and a
        query still waiting for this process stops waiting and gets no figures of it."""
        was_serving = self.state == "serving"
        with self.answers.cond:  # one hold: its figures are in known or earlier, never both
            last = self._newest_figures()
            self.last_figures = None
            if last is not None:
                self.earlier.absorb(last)
            self.state = "lost"
            self.answers.cancel()  # the dead process's answers handed over; queries stop waiting
        orphans = list(self.jobs.values())
        self.jobs.clear()
        return orphans, was_serving

    def _newest_figures(self) -> dict[str, Any] | None:
        """This process's newest figures: of its answers, read or not, the one with the most
        batches (its counters only grow)."""
        known = [f for f in [self.last_figures, *self.answers.received()] if f is not None]
        return max(known, key=lambda f: f["batches"], default=None)

    def send(self, message: tuple[Any, ...]) -> bool:  # a workers/pipe_items.py message
        """Send one message on the pipe; False if the process is gone (its reader notices)."""
        with self._send_lock:
            try:
                self.conn.send(message)
                return True
            except (OSError, ValueError, AttributeError):
                return False

    def figures(self, token: int, until: float) -> dict[str, Any]:
        """This worker's state, and its answer to query ``token`` if it comes before ``until``
        (``answers.expect(token)`` first, before the query is sent)."""
        with self.answers.cond:
            figures = self.answers.wait(token, until, alive=lambda: self.state == "serving")
            if figures is not None and (self.last_figures is None or
                                        figures["batches"] >= self.last_figures["batches"]):
                self.last_figures = figures  # never an older answer read after a newer one
            known = figures or self.last_figures
            earlier = self.earlier.batch_figures()
        device = self.describe.get("engine", {}).get("device", self.device)
        return {"worker": self.index, "pid": getattr(self.process, "pid", None),
                "device": device, "state": self.state, "in_flight": len(self.jobs),
                "restarts": self.restarts.count, "figures": figures, "known_figures": known,
                "earlier_figures": earlier}
