"""Answers to stats queries sent down a child process's pipe, each matched to its query by a
token, so that two queries at once each get their own answer."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

#: Tokens are unique within the front end's process: every query of every child gets its own.
_TOKENS = itertools.count(1)


def new_token() -> int:
    """A token no other stats query of this process carries."""
    return next(_TOKENS)


class StatsAnswers:
    """The queries awaiting a child's answer, by token, and the newest answer received.

    ``cond`` guards them; a holder that must keep more in step with them (a worker's handle,
    its state and earlier figures) holds it around its calls, which take it again (it is
    reentrant)."""

    def __init__(self) -> None:
        self._awaited: dict[int, dict[str, Any] | None] = {}  # token -> answer (None: awaited)
        self.cond = threading.Condition()  # over an RLock
        self.last: dict[str, Any] | None = None

    def expect(self, token: int) -> None:
        """A query ``token`` is about to be sent."""
        with self.cond:
            self._awaited[token] = None

    def answer(self, token: int, figures: dict[str, Any]) -> None:
        """The child answered query ``token`` (kept only while that query awaits it)."""
        with self.cond:
            if token in self._awaited:
                self._awaited[token] = figures
                self.last = figures
                self.cond.notify_all()

    def received(self) -> list[dict[str, Any]]:
        """The answers received that their queries have not taken yet."""
        with self.cond:
            return [figures for figures in self._awaited.values() if figures is not None]

    def cancel(self) -> None:
        """The child is gone: every query awaiting it stops waiting (with no answer)."""
        with self.cond:
            self._awaited.clear()
            self.cond.notify_all()

    def wait(self, token: int, until: float,
             alive: Callable[[], bool] = lambda: True) -> dict[str, Any] | None:
        """Query ``token``'s answer if it comes before ``until`` (monotonic) and while
        ``alive()`` holds (checked whenever the condition is notified), else None."""
        with self.cond:
            self.cond.wait_for(lambda: self._awaited.get(token, {}) is not None or not alive(),
                               max(0.0, until - time.monotonic()))
            return self._awaited.pop(token, None)
