"""``python server.py --role worker --broker redis://...``: the process of one broker worker
(broker/worker.py), from its start to its exit status."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from broker.urls import require_one
from broker.worker import HEARTBEAT_S, RedisWorker
from engines.model_dir import find_models, load_model_info
from scheduling.waits import StartCancelled
from settings.server_config import ServerConfig

log = logging.getLogger("worker")


def run_worker(config: ServerConfig, stop: threading.Event) -> int:
    """Serve the model of ``config.model_dir`` as a worker until ``stop`` is set; the exit
    status (0: drained, 1: timed out or replies lost with the broker, 2: could not start,
    3: a thread of its own died).

    Raises:
        StartCancelled: ``stop`` was set before the worker took work (its sessions may still
            be loading; nothing else runs).
    """
    try:
        found = find_models(config.model_dir)  # a repository of one model serves it, too
        require_one(config.model_dir, [name for name, _ in found])
        config = replace(config, model_dir=str(found[0][1]))
        worker = RedisWorker(config, load_model_info(config.model_dir))
        worker.start(cancel=stop)
    except StartCancelled:
        raise  # not a failure: the caller exits 0
    except Exception as exc:  # noqa: BLE001 - any start failure is exit status 2, logged
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        return 2
    while not stop.wait(HEARTBEAT_S):
        if not worker.healthy:  # never seen; but a worker that takes no work must not linger
            log.critical("a worker thread died; stopping so that a supervisor restarts us")
            worker.stop(config.shutdown_timeout_s)
            return 3
    drained = worker.stop(config.shutdown_timeout_s)
    log.info("worker stopped (%s)", "everything taken was answered" if drained else
             "timed out, or replies could not reach the broker")
    return 0 if drained else 1
