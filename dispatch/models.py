"""The models one server serves: found in ``--model_dir``, each with its own task, backend
(sessions, queue, batching, deadlines, overload) and statistics, and the routing of a request to
one of them.

``--model_dir`` is either one prepared model folder (it holds serving.json) or a repository of
them: every subfolder holding a serving.json is a model named after the subfolder.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engines.base import Engine
from engines.model_dir import ModelInfo, find_models, load_model_info
from engines.sim_engine import SIM_ENGINE_WARNING
from engines.zero_engine import ZERO_ENGINE_WARNING
from protocol.errors import BadRequest
from protocol.messages import (
    REQUEST_PARSERS,
    AuthRequest,
    ModelRequest,
    ModelsRequest,
    PingRequest,
    StatsRequest,
)
from scheduling.waits import raise_if_cancelled
from settings.server_config import ServerConfig
from tasks import task_class
from telemetry.stats import ServerStats
from workers.backend import Backend
from workers.memory_plan import available_mb, plan_workers

log = logging.getLogger(__name__)
start_log = logging.getLogger("server")  # the start-up log's lines (dispatch/serving_log.py)


@dataclass(eq=False)
class ServedModel:
    """One model of the server: what it is, how it is served, what it counted."""

    name: str
    config: ServerConfig  # the server's, with model_dir set to this model's folder
    info: ModelInfo
    op: str
    stats: ServerStats
    fields: dict[str, str] = field(default_factory=dict)
    backend: Backend | None = None

    def describe(self) -> dict[str, Any]:
        """Its entry in the ``models`` op."""
        out = {"name": self.name, "task": self.info.task, "op": self.op,
               "inputs": dict(self.fields), "meaningful": self.info.meaningful,
               "ready": self.backend is not None and self.backend.ready}
        if self.info.warning:
            out["warning"] = self.info.warning
        return out


def make_backend(config: ServerConfig, info: ModelInfo, stats: ServerStats,
                 engine_factory: Callable[[], Engine] | None, name: str) -> Backend:
    """The backend the settings ask for: in this process, worker processes, or a broker
    (``name``: the model's, which names its work stream there)."""
    if config.broker is not None:
        from broker.frontend import RedisBackend  # imports redis only when asked for

        return RedisBackend(config, info, stats, name)
    if config.workers > 1 or config.executors == "on":
        from workers.processes import ProcessBackend

        if engine_factory is not None:
            raise ValueError("engine_factory serves in this process: use workers=1")
        return ProcessBackend(config, info, stats,
                              log_level=logging.getLogger().getEffectiveLevel())
    from workers.local import LocalBackend

    return LocalBackend(config, info, stats, device=config.worker_devices()[0],
                        engine_factory=engine_factory)


#: Ops the server answers itself, whatever models it serves.
#: Engine types that run no model, and what the served models' metadata then warns.
NO_MODEL = {"zero": ZERO_ENGINE_WARNING, "sim": SIM_ENGINE_WARNING}
CONTROL_OPS = frozenset({PingRequest.op, StatsRequest.op, ModelsRequest.op, AuthRequest.op})


def weights_mb(model_dir: str, onnx_file: str, engine_type: str) -> float:
    """The size of the weights file an engine of ``engine_type`` loads, MB (0: none)."""
    name = {"onnx": onnx_file, "pytorch": "model.safetensors"}.get(engine_type)
    path = Path(model_dir) / name if name else None
    return path.stat().st_size / 2**20 if path is not None and path.is_file() else 0.0


def headline(warning: str | None) -> str:
    """A model's warning in one short line for the log: its first clause (up to the colon),
    and where the rest is said (the whole is in ``stats``, ``models`` and serving.json)."""
    first = (warning or "").split(":", 1)[0].strip()[:80]
    return f"{first} (why: client.py --stats)"


class ModelSet:
    """Every served model, in name order, and the routing of requests to them.

    Args:
        config: The server's settings (``model_dir``: one model or a repository).
        stats: The server's statistics; each model's count in them too.
        engine_factory: Builds each session's engine, for every model (default: per settings).
    """

    def __init__(self, config: ServerConfig, stats: ServerStats,
                 engine_factory: Callable[[], Engine] | None = None) -> None:
        self.config = config
        self.stats = stats
        self.engine_factory = engine_factory
        self.models: dict[str, ServedModel] = {}
        self.task_ops: frozenset[str] = frozenset()  # plug-in ops (not built into the protocol)

    def read(self) -> None:
        """Find the models and read their metadata (nothing is loaded yet).

        Raises:
            ModelDirError: no model, or unreadable metadata.
            ValueError: a task that cannot be loaded, or a layout the settings cannot serve.
        """
        found: dict[str, ServedModel] = {}  # published whole: the HTTP API reads it meanwhile
        for name, path in find_models(self.config.model_dir):
            info = load_model_info(path)
            if self.config.inference_engine_type in NO_MODEL:  # nothing runs the weights
                warning = NO_MODEL[self.config.inference_engine_type]
                info = replace(info, meaningful=False, warning=warning)
            cls = task_class(info.task)
            if cls.op in CONTROL_OPS:  # the built-in op would always win: never reachable
                raise ValueError(f"model {name}: task {info.task!r} answers op {cls.op!r}, "
                                 f"which the server answers itself; give the task another op")
            found[name] = ServedModel(
                name=name, config=replace(self.config, model_dir=str(path)), info=info,
                op=cls.op, stats=ServerStats(cls.op, self.stats), fields=dict(cls.fields))
        self.models = found
        self.task_ops = frozenset(m.op for m in self if m.op not in REQUEST_PARSERS)
        self._plan_workers()

    def _plan_workers(self) -> None:
        """With ``--workers N`` (each worker process holding one model): N per model where the
        memory holds them, fewer where it does not (workers/memory_plan.py); said in the log."""
        cfg = self.config
        if cfg.workers <= 1 or cfg.executors == "on" or cfg.broker is not None:
            return
        sizes = [weights_mb(m.config.model_dir, m.info.onnx_file, cfg.inference_engine_type)
                 for m in self]
        plan = plan_workers(cfg.workers, sizes, available_mb())
        start_log.info("workers: %s", plan.why)
        if plan.workers != cfg.workers:
            for model in self:
                model.config = replace(model.config, workers=plan.workers)

    def start(self, cancel: threading.Event | None = None,
              on_ready: Callable[[ServedModel], None] | None = None) -> None:
        """Load every model's task and engines, one model after another (each warms up alone).

        Args:
            cancel: Give up once this is set (a stop asked during start-up); ``stop`` then
                stops what was started.
            on_ready: Called with each model as it is ready (the start-up log's line).

        Raises:
            RuntimeError: a model could not load.
            StartCancelled: ``cancel`` was set before every model was loaded.
        """
        for model in self:
            raise_if_cancelled(cancel)
            if not model.info.meaningful:
                start_log.warning("model %s: %s", model.name, headline(model.info.warning))
                start_log.debug("model %s: %s", model.name, model.info.warning)
            model.backend = make_backend(model.config, model.info, model.stats,
                                         self.engine_factory, model.name)
            model.backend.start(cancel)
            if on_ready is not None:
                on_ready(model)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models.values())

    def __len__(self) -> int:
        return len(self.models)

    def route(self, request: ModelRequest) -> ServedModel:
        """The model that serves ``request``: the one it names, else the only one serving its op.

        Raises:
            BadRequest: no such model, a model of another task, or several serve the op and the
                request names none.
        """
        if request.model is not None:
            model = self.models.get(request.model)
            if model is None:
                raise BadRequest(f"unknown model {request.model[:64]!r} (served: "
                                 f"{', '.join(self.models)})", request_id=request.id)
            if model.op != request.op:
                raise BadRequest(f"model {model.name!r} serves {model.op!r} requests, not "
                                 f"{request.op!r}", request_id=request.id)
            return model
        serving = [m for m in self if m.op == request.op]
        if len(serving) == 1:
            return serving[0]
        if not serving:
            raise BadRequest(f"no model here serves {request.op!r} requests (served: "
                             f"{self._ops()})", request_id=request.id)
        raise BadRequest(f"several models serve {request.op!r} requests "
                         f"({', '.join(m.name for m in serving)}): name one with 'model'",
                         request_id=request.id)

    def _ops(self) -> str:
        return ", ".join(f"{m.name}: {m.op}" for m in self)

    @property
    def ready(self) -> bool:
        """Every model loaded and serving."""
        return bool(self.models) and all(m.backend is not None and m.backend.ready
                                         for m in self)

    def flush(self) -> None:
        """Hand on what one read of a connection admitted, for every model."""
        for model in self:
            if model.backend is not None:
                model.backend.flush()

    def purge_gone(self) -> None:
        """Drop the waiting requests whose client has left, from every model's queue."""
        for model in self:
            if model.backend is not None:
                for item in model.backend.purge(lambda item: not item.alive()):
                    item.drop()

    def stop(self, timeout: float) -> bool:
        """Stop every model's backend (draining, within ``timeout`` in all); True if all
        admitted work was run."""
        until = time.monotonic() + timeout
        drained = True
        for model in self:
            if model.backend is not None:
                drained &= model.backend.stop(max(0.0, until - time.monotonic()))
        return drained

