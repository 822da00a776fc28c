"""The ``stats`` op's result: the server's figures, and every model's, assembled here beside the
served models (dispatch/models.py) whose backends hold them.

Each model counts its requests, batches and times in its own ``ServerStats``, which also counts
them in the server's; figures kept in worker processes are added in when asked for. The top level
of the result is the server's, and ``models`` has each model's own. A server of one model also
names that model, its batching and its engine at the top level; a repository's top level does
not lump several models into one description: each is in ``models``.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from broker.urls import redact
from telemetry.memory import process_memory
from telemetry.stats import ServerStats
from workers.figures import summarize_worker

if TYPE_CHECKING:
    from dispatch.models import ModelSet, ServedModel
    from settings.server_config import ServerConfig


def model_figures(model: ServedModel) -> tuple[list[dict[str, Any]], ServerStats]:
    """A model's worker entries (each asked for its figures now) and its statistics summed
    over them."""
    backend = model.backend
    if backend is None:
        return [], model.stats
    figures = backend.worker_figures()
    return figures, backend.summed(model.stats, figures)


def collect_stats(config: ServerConfig, stats: ServerStats, models: ModelSet,
                  ready: bool) -> tuple[dict[str, Any], ServerStats, dict[str, ServerStats]]:
    """The ``stats`` result, the summed statistics it came from, and each model's."""
    total, per_model, workers, entries = stats, {}, [], {}
    for model in models:
        figures, merged = model_figures(model)
        per_model[model.name] = merged
        if model.backend is not None:  # the server's own counts every model's already
            total = model.backend.summed(total, figures)
        mine = [{**summarize_worker(worker), "model": model.name} for worker in figures]
        workers += mine
        entries[model.name] = _model_entry(model, merged, config)
        entries[model.name]["memory_mb"] = model_memory_mb(model, mine)
    result = total.snapshot()
    result["queue_depth"] = sum(entry["queue_depth"] for entry in entries.values())
    result["ready"] = ready
    result["config"] = {k: v for k, v in asdict(config).items() if v is not None}
    if config.broker is not None:
        result["config"]["broker"] = redact(config.broker)  # no password in stats
    served = list(models)
    if len(served) == 1:  # one model: the top level describes it too
        only = served[0]
        result["model"] = _description(only)
        result["batching"] = entries[only.name]["batching"]
        for key in ("engine", "broker"):
            if key in entries[only.name]:
                result[key] = entries[only.name][key]
    result["workers"] = workers
    executors = [entry for model in models for entry in _executor_figures(model)]
    if executors:
        result["executors"] = executors
    busy = device_busy(workers + result.get("executors", []))
    if busy:
        result["devices"] = busy
    result["models"] = entries
    result["memory"] = memory_summary(workers)
    return result, total, per_model


def memory_summary(workers: list[dict[str, Any]]) -> dict[str, float | None]:
    """This process's resident memory, and what it and its worker processes on this machine
    hold together (PSS: pages shared among them counted once), in MB."""
    own = process_memory()
    others = {w["pid"]: w["memory_mb"].get("pss_mb") or 0.0 for w in workers
              if w.get("memory_mb") and w.get("pid") != os.getpid() and "host" not in w}
    total = None if own["pss_mb"] is None else round(own["pss_mb"] + sum(others.values()), 1)
    return {"process_rss_mb": own["rss_mb"], "process_pss_mb": own["pss_mb"],
            "total_pss_mb": total}


def model_memory_mb(model: ServedModel, workers: list[dict[str, Any]]) -> float | None:
    """What a model holds, in MB: in worker processes of its own (a broker's too, wherever
    they run), their PSS summed; in this process, what loading it added to the process (its
    weights, runtime and tokenizer)."""
    own = [w for w in workers if w.get("memory_mb") and w.get("pid") != os.getpid()]
    if own:
        return round(sum(w["memory_mb"].get("pss_mb") or 0.0 for w in own), 1)
    return getattr(model.backend, "memory_mb", None)


def _executor_figures(model: ServedModel) -> list[dict[str, Any]]:
    """The model's executors (``--executors on``), each asked for its figures now."""
    executors = getattr(model.backend, "executors", None)
    return [{**entry, "model": model.name} for entry in executors.figures()] if executors else []


def device_busy(workers: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each device's busy fraction of late, where its engines know it (the sim engine), from
    the workers and executors on it that answered this query (each reads the same device
    file; the highest, as one that read it a moment before the others may have missed a
    run)."""
    out: dict[str, dict[str, float]] = {}
    for worker in workers:
        if "device_busy" in worker:
            entry = out.setdefault(str(worker["device"]), {"device_busy": 0.0})
            entry["device_busy"] = max(entry["device_busy"], worker["device_busy"])
    return out


def _description(model: ServedModel) -> dict[str, Any]:
    """A served model's ``model`` entry: its name, source and whether its outputs mean
    anything (with the warning that says why not)."""
    info = model.info
    out = {"name": info.model_name, "source": info.source, "meaningful": info.meaningful}
    if info.warning:
        out["warning"] = info.warning
    return out


def _model_entry(model: ServedModel, merged: ServerStats, config: ServerConfig) -> dict[str, Any]:
    """One model's part of the result: what it is, its figures, its batching and engine."""
    snap = merged.snapshot()
    described = model.backend.describe() if model.backend is not None else {}
    entry = {**_description(model), "task": model.info.task, "op": model.op,
             "ready": model.backend is not None and model.backend.ready,
             "queue_depth": model.backend.queue_depth if model.backend is not None else 0}
    for key in ("requests", "admitted", "in_flight", "batches", "batch_size_histogram",
                "mean_batch_size", "batch_rows", "queue_time", "engine_time", "request_time"):
        entry[key] = snap[key]
    entry["batching"] = {"mode": config.batching,
                         "max_batch_size": described.get("max_batch_size", config.max_batch_size),
                         "max_batch_tokens": config.max_batch_tokens,
                         "cost_model_ms": described.get("cost_model_ms", {})}
    for key in ("engine", "broker"):
        if key in described:
            entry[key] = described[key]
    return entry
