"""The start-up log a person reads: the engine and the layout, the models as they start
loading, one line per model as it is ready, and where the server serves and how to stop it.
Each line stays under about 120 characters; the detail (each model's engine, its batch cost
model, the CPU scheduling, every limit) is at DEBUG (``--log_level DEBUG``), and all of it is
in ``client.py --stats``.

A broker front end (``--broker``) has a tokenizer and no engine: its lines say that the broker's
workers run the model, each with its own engine, sessions and batching (their own settings).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from dispatch.models import ModelSet, ServedModel
from settings.server_config import ServerConfig

log = logging.getLogger("server")  # the server's start-up log, whichever module writes it


def log_start(config: ServerConfig, scheduling: str, engine: str, layout: str) -> None:
    """The first lines: the engine (none said: a ``--broker`` front end runs none) and the
    layout chosen, each with why, and (at DEBUG) the CPU scheduling policy."""
    log.debug("CPU scheduling: %s", scheduling)
    if engine:
        log.info("engine: %s", engine)
    log.info("layout: %s", layout)


def log_loading(config: ServerConfig, models: ModelSet, endpoints: str) -> None:
    """The line before the models load: which, and the addresses already bound."""
    names = ", ".join(m.name for m in models)
    if config.broker is not None:
        log.info("front end for %s: tokenizing here, the broker's workers run the models",
                 names)
    else:
        log.info("loading %s; %s bound, accepting once loaded", names, endpoints)


def log_ready(model: ServedModel) -> None:
    """One line as a model is ready: name, task, engine, precision, device, sessions (and
    worker processes), engines and memory; its details at DEBUG."""
    assert model.backend is not None
    config = model.config
    described = model.backend.describe()
    _log_details(config, model, described)
    if config.broker is not None:
        serving = described["broker"]["serving_workers"]
        log.info("model %s ready: %s, tokenized here; %d broker workers serving now",
                 model.name, model.info.task, serving)
        return
    engine = described.get("engine", {})
    log.info("model %s ready: %s, %s %s on %s, %s", model.name, model.info.task,
             engine.get("type", config.inference_engine_type),
             engine.get("precision", config.precision),
             engine.get("device", config.device), _sessions(config, described))


def _sessions(config: ServerConfig, described: dict[str, Any]) -> str:
    """Sessions, processes, engines and memory, in words: ``2 sessions (1 engine, 118 MB)``,
    ``2 workers x 2 sessions (1 engine each; 231 + 229 MB)``."""
    sessions = f"{config.num_inference_sessions} session" + \
        ("s" if config.num_inference_sessions != 1 else "")
    engines = described.get("engines", config.num_inference_sessions)
    engines_words = f"{engines} engine" + ("s" if engines != 1 else "")
    if config.workers > 1:
        sizes = [m for m in described.get("workers_mb", []) if m is not None]
        memory = "; " + " + ".join(f"{m:.0f}" for m in sizes) + " MB" if sizes else ""
        return f"{config.workers} workers x {sessions} ({engines_words} each{memory})"
    memory = described.get("memory_mb")
    return f"{sessions} ({engines_words}" + (f", {memory:.0f} MB)" if memory else ")")


def _log_details(config: ServerConfig, model: ServedModel, described: dict[str, Any]) -> None:
    """What a person asks after something looks wrong, at DEBUG: the model's source and
    folder, its engine in full, and its batch cost model after warm-up."""
    what = (f"model {model.name}: {model.info.model_name} ({model.info.source}) from "
            f"{os.path.abspath(model.config.model_dir)}")
    if config.broker is not None:  # no engine here: the broker's workers run it
        log.debug("%s; run by the broker's workers (--role worker), each with its own engine, "
                  "sessions and batching", what)
        return
    log.debug("%s; engine: %s", what, described.get("engine", {}).get("description", "?"))
    if config.batching == "auto":
        log.debug("model %s: batch cost model after warm-up (ms per batch, ROWSxLENGTH%s): %s",
                  model.name, ", worker 0" if config.workers > 1 else "",
                  ", ".join(f"{shape} {ms:.1f}" for shape, ms in
                            described.get("cost_model_ms", {}).items()))


def log_serving(config: ServerConfig, endpoints: str, local_only: bool,
                tokens: int | None, token_file: str | None) -> None:
    """The lines once every model serves, ending with ``serving on ADDRESSES; Ctrl+C stops``.

    Args:
        config: The server's settings.
        endpoints: Every address served, in words.
        local_only: Only this machine can connect (said, with how to serve others).
        tokens: How many authentication tokens were read (None: no authentication).
        token_file: Where they were read from.
    """
    cfg = config
    if cfg.broker is None:  # a broker's workers have sessions and batching of their own
        log.info("batching %s: at most %d requests, %d tokens, %g ms of waiting", cfg.batching,
                 cfg.max_batch_size, cfg.max_batch_tokens, cfg.max_queue_delay_ms)
    log.debug("limits: queue %d per model, request timeout %g ms, %d connections, idle %g s, "
              "frame %g s, frame size %d B, question %d chars, context %d chars "
              "(docs/operations.md)", cfg.max_queue, cfg.request_timeout_ms,
              cfg.max_connections, cfg.idle_timeout_s, cfg.frame_timeout_s,
              cfg.max_frame_size, cfg.max_question_chars, cfg.max_context_chars)
    if tokens is not None:
        log.info("token authentication: %d tokens from %s", tokens, token_file)
    if local_only:
        log.info("this machine only can connect (--host 0.0.0.0 to serve others)")
    log.info("serving on %s; Ctrl+C stops", endpoints)
