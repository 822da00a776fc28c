"""``python server.py --role worker --broker redis://...``: the process of one broker worker,
from its start to its exit status. It holds the models of ``--model_dir`` that ``--models``
names (all by default), each one a ``RedisWorker`` (broker/worker.py) of its own sessions on
that model's work stream."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from broker.presence import HEARTBEAT_S
from broker.worker import RedisWorker
from engines.model_dir import find_models, load_model_info
from scheduling.waits import StartCancelled
from settings.server_config import ServerConfig

log = logging.getLogger("worker")


def chosen_models(config: ServerConfig) -> list[tuple[str, str]]:
    """(name, folder) of each model this worker holds: ``--models`` of ``--model_dir``'s.

    Raises:
        ValueError: ``--models`` names a model ``--model_dir`` does not hold, or none.
        ModelDirError: no prepared model in ``--model_dir``.
    """
    found = {name: str(path) for name, path in find_models(config.model_dir)}
    if config.models is None:
        return list(found.items())
    names = [name.strip() for name in config.models.split(",") if name.strip()]
    unknown = [name for name in names if name not in found]
    if unknown or not names:
        raise ValueError(f"--models {config.models!r}: {config.model_dir} holds "
                         f"{', '.join(found)}; no {', '.join(unknown) or 'model named'}")
    return [(name, found[name]) for name in dict.fromkeys(names)]


def start_workers(config: ServerConfig, stop: threading.Event) -> list[RedisWorker]:
    """A started ``RedisWorker`` for each model this worker holds, one after another, once
    every one of them is known to be the model the front ends serve by its name.

    Raises:
        StartCancelled: ``stop`` was set first (those started are stopped).
        Exception: a model could not start (those started are stopped).
    """
    chosen = [RedisWorker(replace(config, model_dir=folder), load_model_info(folder), name)
              for name, folder in chosen_models(config)]
    for worker in chosen:  # before any loads and takes work: a mismatch fails the start alone
        worker.check_expected()
    started: list[RedisWorker] = []
    try:
        for worker in chosen:
            worker.start(cancel=stop)
            started.append(worker)
    except BaseException:
        _stop_all(started, config.shutdown_timeout_s)
        raise
    return chosen


def run_worker(config: ServerConfig, stop: threading.Event) -> int:
    """Serve this worker's models until ``stop`` is set; the exit status (0: drained, 1: timed
    out or replies lost with the broker, 2: could not start, 3: a thread of its own died).

    Raises:
        StartCancelled: ``stop`` was set before every model's worker took work (those that
            had are drained; the others' sessions may still be loading).
    """
    try:
        workers = start_workers(config, stop)
    except StartCancelled:
        raise  # not a failure: the caller exits 0
    except Exception as exc:  # noqa: BLE001 - any start failure is exit status 2, logged
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        return 2
    while not stop.wait(HEARTBEAT_S):
        if not all(worker.healthy for worker in workers):  # never seen; but a worker that
            log.critical("a worker thread died; stopping so that a supervisor restarts us")
            _stop_all(workers, config.shutdown_timeout_s)  # takes no work must not linger
            return 3
    drained = _stop_all(workers, config.shutdown_timeout_s)
    log.info("worker stopped (%s)", "everything taken was answered" if drained else
             "timed out, or replies could not reach the broker")
    return 0 if drained else 1


def _stop_all(workers: list[RedisWorker], timeout: float) -> bool:
    """Stop every model's worker at once (they drain side by side); True if all drained."""
    results: list[bool] = []
    threads = [threading.Thread(target=lambda w=worker: results.append(w.stop(timeout)))
               for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(results) == len(workers) and all(results)
