"""The start-up log's account of what is served and how: the models as they start loading, then
each model and what runs it, the batching, the limits and where the server listens.

A broker front end (``--broker``) has a tokenizer and no engine: its lines say that the broker's
workers run the model, each with its own engine, sessions and batching (their own settings).
"""

from __future__ import annotations

import logging
import os

from dispatch.models import ModelSet, ServedModel
from settings.server_config import ServerConfig

log = logging.getLogger("server")  # the server's start-up log, whichever module writes it


def log_loading(config: ServerConfig, models: ModelSet, endpoints: str) -> None:
    """The line before the models load: which, into what, and the addresses already bound."""
    names = ", ".join(f"{m.name} ({m.info.task})" for m in models)
    if config.broker is not None:
        log.info("front end for %s: tokenizing here, the model runs in the workers of the "
                 "broker (%s bound)", names, endpoints)
        return
    where = f"{config.workers} worker processes of " if config.workers > 1 else ""
    log.info("loading %s into %s%d %s sessions each (%s bound; accepting once loaded)", names,
             where, config.num_inference_sessions, config.inference_engine_type, endpoints)


def log_serving(config: ServerConfig, models: ModelSet, endpoints: str,
                tokens: int | None, token_file: str | None) -> None:
    """The lines once every model serves, ending with ``serving on ADDRESSES``.

    Args:
        config: The server's settings.
        models: The models, started.
        endpoints: Every address served, in words.
        tokens: How many authentication tokens were read (None: no authentication).
        token_file: Where they were read from.
    """
    cfg = config
    for model in models:
        _log_model(cfg, model)
    if cfg.broker is None:  # a broker's workers have sessions and batching of their own
        log.info("%s%d inference sessions per model; batching %s (max %d requests, %d tokens, "
                 "delay %g ms)", f"{cfg.workers} workers on {', '.join(cfg.worker_devices())}, "
                 "each with " if cfg.workers > 1 else "", cfg.num_inference_sessions,
                 cfg.batching, cfg.max_batch_size, cfg.max_batch_tokens, cfg.max_queue_delay_ms)
    log.info("limits: queue %d per model, request timeout %g ms, %d connections, idle %g s, "
             "frame %g s, frame size %d B, question %d chars, context %d chars "
             "(docs/operations.md)", cfg.max_queue, cfg.request_timeout_ms,
             cfg.max_connections, cfg.idle_timeout_s, cfg.frame_timeout_s,
             cfg.max_frame_size, cfg.max_question_chars, cfg.max_context_chars)
    if tokens is not None:
        log.info("token authentication: %d tokens from %s; a connection must authenticate "
                 "within %g s (auth_timeout)", tokens, token_file, cfg.auth_timeout_s)
    log.info("serving on %s", endpoints)


def _log_model(config: ServerConfig, model: ServedModel) -> None:
    """What one model is, and what runs it: its engine here (or in the worker processes), or,
    behind a broker, the broker's workers."""
    assert model.backend is not None
    described = model.backend.describe()
    what = (f"model {model.name}: {model.info.model_name} ({model.info.source}, task "
            f"{model.info.task}) from {os.path.abspath(model.config.model_dir)}")
    if config.broker is not None:
        serving = described["broker"]["serving_workers"]
        log.info("%s; tokenized here, run by the broker's workers (--role worker), each with its "
                 "own engine, sessions and batching; %d serving now", what, serving)
        return
    log.info("%s; engine: %s", what, described.get("engine", {}).get("description", "?"))
    if config.batching == "auto":
        log.info("model %s: batch cost model after warm-up (ms per batch, ROWSxLENGTH%s): %s",
                 model.name, ", worker 0" if config.workers > 1 else "",
                 ", ".join(f"{shape} {ms:.1f}" for shape, ms in
                           described.get("cost_model_ms", {}).items()))
