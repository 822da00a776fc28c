"""The inference sessions as one pool: start them, watch them, replace one that dies.

A session dies when an exception escapes its serving loop (a ``BaseException`` from an engine, a
bug of ours) or when a replacement cannot load its engine. The pool logs it, counts it, and starts
a replacement with a fresh engine: at once after a crash, then with a growing back-off while
replacements keep failing to load, so a broken GPU does not spin the CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engines.base import Engine
from scheduling.session import InferenceSession
from scheduling.waits import Restarts, wait_until_set

log = logging.getLogger(__name__)



class SessionPool:
    """``count`` inference-session threads on one queue, kept at full strength.

    Args:
        count: Number of sessions.
        make: Builds (does not start) session ``index``; ``initial`` is False for replacements,
            which are built the same way but may skip work only the first sessions need.
        on_restart: Called once per replacement started (for statistics).
    """

    def __init__(self, count: int, make: Callable[[int, bool], InferenceSession],
                 on_restart: Callable[[], None] = lambda: None) -> None:
        if count < 1:
            raise ValueError("a pool needs at least one session")
        self.count = count
        self._make = make
        self._on_restart = on_restart
        self._lock = threading.Lock()
        self.sessions: list[InferenceSession] = []
        self._restarts = [Restarts() for _ in range(count)]  # per index
        self._timers: dict[int, threading.Timer] = {}
        self._started = False
        self._draining = False
        self._stopping = False

    def start(self, cancel: threading.Event | None = None) -> None:
        """Start every session and wait until each has loaded and warmed up.

        Args:
            cancel: Stop waiting once this is set (a stop asked during start-up). The sessions
                go on loading: closing their queue makes them end, and ``join`` waits for them.

        Raises:
            RuntimeError: a session could not load its engine (the server cannot start).
            StartCancelled: ``cancel`` was set before every session was ready.
        """
        self.sessions = [self._build(i, initial=True) for i in range(self.count)]
        for session in self.sessions:
            session.start()
        for session in self.sessions:
            wait_until_set(session.ready, cancel)  # the main thread: signals must be handled
        failed = [s for s in self.sessions if s.load_error is not None]
        if failed:
            error = failed[0].load_error
            raise RuntimeError(f"{failed[0].name} could not load its engine: {error}") from error
        self._started = True

    @property
    def serving(self) -> bool:
        """True while every session is loaded, warmed up and taking batches."""
        with self._lock:
            return bool(self.sessions) and all(s.serving for s in self.sessions)

    @property
    def engine(self) -> Engine | None:
        """The first serving session's engine (for describing what is served)."""
        with self._lock:
            return next((s.engine for s in self.sessions if s.engine is not None), None)

    def release_memory(self) -> None:
        """Ask each distinct engine of the sessions to give back its past batches' memory
        (engines shared by several sessions are asked once)."""
        with self._lock:
            engines = {id(s.engine): s.engine for s in self.sessions if s.engine is not None}
        for engine in engines.values():
            engine.release_memory()

    def _build(self, index: int, initial: bool) -> InferenceSession:
        session = self._make(index, initial)
        session.on_exit = self._on_exit
        return session

    def _on_exit(self, session: InferenceSession) -> None:
        """A session stopped abnormally (called from its thread): schedule its replacement."""
        with self._lock:
            if not self._started or self._stopping:
                return
            others = any(s.is_alive() for s in self.sessions if s is not session)
            if self._draining and others:
                log.error("%s died while draining; the other sessions finish the work",
                          session.name)
                return
            index = session.index
            # it had loaded where it crashed (the only way a loaded one stops)
            delay = self._restarts[index].next_delay(served=session.crash is not None)
            what = "died" if session.crash is not None else "could not load its engine"
            reason = session.crash or session.load_error
            log.error("%s %s (%s: %s); starting a replacement in %g s (restart #%d)", session.name,
                      what, type(reason).__name__, reason, delay,
                      sum(r.count for r in self._restarts))
            timer = threading.Timer(delay, self._replace, args=(index,))
            timer.name, timer.daemon = f"replace-session-{index}", True
            self._timers[index] = timer
            timer.start()
        self._on_restart()

    def _replace(self, index: int) -> None:
        with self._lock:
            self._timers.pop(index, None)
            if self._stopping:
                return
            session = self._build(index, initial=False)
            self.sessions[index] = session
            session.start()  # it logs when its engine is loaded and serving

    def join(self, timeout: float) -> bool:
        """Wait for every session to drain the closed queue and stop; then replace no more.

        A session that dies while draining is replaced only if no other session is left to
        finish the admitted work.

        Returns:
            True if every session stopped within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            self._draining = True  # from now on, replace a session only if it was the last
        while True:
            with self._lock:
                current = list(self.sessions)
            for session in current:
                session.join(max(0.0, deadline - time.monotonic()))
            with self._lock:
                settled = current == self.sessions and not self._timers
                done = settled and not any(s.is_alive() for s in current)
                if done or time.monotonic() >= deadline:
                    self._stopping = True
                    for timer in self._timers.values():
                        timer.cancel()
                    return done
            time.sleep(0.01)  # a replacement is pending: wait for it to start
