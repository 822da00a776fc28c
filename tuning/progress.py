"""The tuner's progress bar: seconds of the budget spent, and what is running now."""

from __future__ import annotations

import threading
import time
from typing import Any


class Progress:
    """A tqdm bar over the budget's seconds, moved once a second, showing the current trial
    and the best so far; nothing where ``enabled`` is false. A ``with`` block."""

    def __init__(self, budget_s: float, enabled: bool) -> None:
        self._budget_s, self._enabled = budget_s, enabled
        self._bar: Any = None
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._tick, name="progress", daemon=True)

    def __enter__(self) -> Progress:
        if self._enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=round(self._budget_s), unit="s", desc="tuning",
                             bar_format="{desc}: {bar} {n_fmt}/{total_fmt} s {postfix}")
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._bar is not None:
            self._thread.join()
            self._bar.close()

    def say(self, text: str) -> None:
        """Show ``text`` beside the bar."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            spent = min(round(time.perf_counter() - self._started), self._bar.total)
            self._bar.update(max(0, spent - self._bar.n))
