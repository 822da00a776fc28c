"""Answers to stats queries sent down a child process's pipe, each matched to its query by a
token, so that two queries at once each get their own answer."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

#: Tokens are unique within the front end's process: every query of every child gets its own.
_TOKENS = itertools.count(1)


def new_token() -> int:
    """A token no other stats query of this process carries."""
    return next(_TOKENS)


class StatsAnswers:
    """The queries awaiting a child's answer, by token, and the newest answer received."""

    def __init__(self) -> None:
        self._awaited: dict[int, dict[str, Any] | None] = {}  # token -> answer (None: awaited)
        self._cond = threading.Condition()
        self.last: dict[str, Any] | None = None

    def expect(self, token: int) -> None:
        """A query ``token`` is about to be sent."""
        with self._cond:
            self._awaited[token] = None

    def answer(self, token: int, figures: dict[str, Any]) -> None:
        """The child answered query ``token`` (kept only while that query awaits it)."""
        with self._cond:
            if token in self._awaited:
                self._awaited[token] = figures
                self.last = figures
                self._cond.notify_all()

    def cancel(self) -> None:
        """The child is gone: every query awaiting it stops waiting (with no answer)."""
        with self._cond:
            self._awaited.clear()
            self._cond.notify_all()

    def wait(self, token: int, until: float) -> dict[str, Any] | None:
        """Query ``token``'s answer if it comes before ``until`` (monotonic), else None."""
        with self._cond:
            self._cond.wait_for(lambda: self._awaited.get(token, {}) is not None,
                                max(0.0, until - time.monotonic()))
            return self._awaited.pop(token, None)
