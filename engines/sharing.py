"""One engine for every session of a model in a process, where the engine allows it.

A model's weights then sit in memory once per engine, however many session threads run them
(ONNX Runtime's ``run`` is thread-safe: each session's batches run side by side on the same
ONNX Runtime session). An engine that is not ``shareable`` (device buffers kept per shape, CUDA graphs, a
``device_s`` per run) is loaded once per session, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engines.base import Engine


class SharedEngines:
    """Hands each session an engine: the first one loaded, where it is ``shareable``.

    Args:
        factory: Loads one engine (in the calling session's thread).
    """

    def __init__(self, factory: Callable[[], Engine]) -> None:
        self._factory = factory
        self._loading = threading.Lock()  # the first load: the others wait to share it
        self._lock = threading.Lock()
        self._shared: Engine | None = None
        self._users = 0
        self._first_done = False

    def acquire(self) -> Engine:
        """The shared engine, or a new one (loaded here) where it cannot be shared.

        Raises:
            Exception: whatever the factory raises (a later call tries again).
        """
        with self._loading:
            with self._lock:
                if self._shared is not None:
                    self._users += 1
                    return self._shared
            if not self._first_done:
                engine = self._factory()
                self._first_done = True
                if engine.shareable:
                    with self._lock:
                        self._shared, self._users = engine, 1
                return engine
        return self._factory()  # not shareable: one each, loaded side by side

    def release(self, engine: Engine) -> None:
        """A session is done with ``engine``: close it, or, shared, once its last user is."""
        with self._lock:
            if engine is self._shared:
                self._users -= 1
                if self._users > 0:
                    return
                self._shared, self._first_done = None, False
        engine.close()

    @property
    def shared(self) -> Engine | None:
        """The engine every session shares, while one is."""
        with self._lock:
            return self._shared
