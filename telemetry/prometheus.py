"""Prometheus exposition of the server's statistics, plus GPU figures through NVML.

The collector reads ``ServerStats`` at scrape time (one source of truth with the ``stats`` op) and
yields conventional metric families: ``_total`` counters, ``_seconds`` histograms, gauges. GPU
series come from nvidia-ml-py and are absent (not zero) when no NVIDIA GPU or driver is present.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from telemetry.stats import TIME_BUCKETS, Timing

log = logging.getLogger(__name__)
PREFIX = "qa_server"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class StatsSource(Protocol):
    """What the collector reads (server.InferenceServer satisfies it)."""

    def collect_stats(self) -> tuple[dict[str, Any], Any, dict[str, Any]]:
        """The stats op's result, the ServerStats (summed over models and workers) it came
        from, and each model's ServerStats (dispatch/report.py)."""


class ServerCollector(Collector):
    """Turns one server's statistics into Prometheus metric families at each scrape."""

    def __init__(self, server: StatsSource, gpus: GpuProbe | None = None) -> None:
        self.server = server
        self.gpus = gpus if gpus is not None else GpuProbe()

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family (called by prometheus-client on each scrape)."""
        snap, stats, per_model = self.server.collect_stats()
        yield _info(snap)
        requests = CounterMetricFamily(f"{PREFIX}_requests", "Requests answered, by op and outcome "
                                       "(ok or the error code)", labels=["op", "outcome"])
        for op, outcomes in snap["requests"].items():
            for outcome, n in outcomes.items():
                requests.add_metric([op, outcome], n)
        yield requests
        yield _gauge("queue_depth", "Requests waiting in the shared queue", snap["queue_depth"])
        yield _gauge("in_flight_requests", "Admitted requests not yet answered", snap["in_flight"])
        yield _gauge("ready", "1 when every session is loaded and the server is not draining",
                     int(snap["ready"]))
        yield _gauge("uptime_seconds", "Seconds since the server started", snap["uptime_s"])
        yield _gauge("connections_open", "Client connections open now", snap["connections_open"])
        yield CounterMetricFamily(f"{PREFIX}_connections", "Client connections accepted",
                                  value=snap["connections_total"])
        events = CounterMetricFamily(f"{PREFIX}_events", "Connections refused or closed by a "
                                     "limit, and sessions replaced", labels=["event"])
        for event, n in snap["events"].items():
            events.add_metric([event], n)
        yield events
        yield CounterMetricFamily(f"{PREFIX}_batches", "Batches run by all sessions",
                                  value=snap["batches"])
        yield CounterMetricFamily(f"{PREFIX}_batch_rows", "Windows (engine rows) run in batches",
                                  value=snap["batch_rows"])
        yield _batch_histogram(snap["batch_size_histogram"])
        yield _time_histogram("queue_time_seconds", "Time from admission until a session took "
                              "the request", stats.queue_time)
        yield _time_histogram("engine_time_seconds", "Engine time per batch", stats.engine_time)
        yield _time_histogram("request_duration_seconds", "Time from admission until the reply "
                              "was written", stats.request_time)
        yield from _memory_families(snap)
        yield from _model_families(snap.get("models", {}), per_model)
        yield from _worker_families(snap.get("workers", []))
        yield from _device_share(snap.get("devices", {}))
        yield from _executor_families(snap.get("executors", []))
        yield from _broker_families({name: entry["broker"] for name, entry
                                     in snap.get("models", {}).items() if "broker" in entry})
        yield from self.gpus.collect()


def _model_families(entries: dict[str, dict[str, Any]],
                    per_model: dict[str, Any]) -> Iterator[Metric]:
    """Per-model series, each with a ``model`` label (the families above are their sums, plus
    what no model was found for)."""
    label = ["model"]
    info = GaugeMetricFamily(f"{PREFIX}_model_info", "A served model (value is always 1)",
                             labels=["model", "task", "name", "meaningful"])
    requests = CounterMetricFamily(f"{PREFIX}_model_requests", "Requests answered, by model, op "
                                   "and outcome", labels=["model", "op", "outcome"])
    gauges = {key: GaugeMetricFamily(f"{PREFIX}_model_{name}", doc, labels=label) for key, name,
              doc in (("ready", "ready", "1 while the model's sessions are all serving"),
                      ("queue_depth", "queue_depth", "Requests waiting in the model's queue"),
                      ("in_flight", "in_flight_requests", "Admitted, not yet answered"))}
    batches = CounterMetricFamily(f"{PREFIX}_model_batches", "Batches run", labels=label)
    sizes = HistogramMetricFamily(f"{PREFIX}_model_batch_size", "Requests per batch",
                                  labels=label)
    times = {key: HistogramMetricFamily(f"{PREFIX}_model_{name}", doc, labels=label)
             for key, name, doc in (
                 ("queue_time", "queue_time_seconds", "Admission until a session took it"),
                 ("engine_time", "engine_time_seconds", "Engine time per batch"),
                 ("request_time", "request_duration_seconds", "Admission until the reply"))}
    for name, entry in entries.items():
        info.add_metric([name, entry["task"], entry["name"], str(entry["meaningful"]).lower()], 1)
        for op, outcomes in entry["requests"].items():
            for outcome, n in outcomes.items():
                requests.add_metric([name, op, outcome], n)
        gauges["ready"].add_metric([name], int(entry["ready"]))
        gauges["queue_depth"].add_metric([name], entry["queue_depth"])
        gauges["in_flight"].add_metric([name], entry["in_flight"])
        batches.add_metric([name], entry["batches"])
        buckets, total = _batch_buckets(entry["batch_size_histogram"])
        sizes.add_metric([name], buckets, total)
        stats = per_model[name]
        for key, family in times.items():
            timing = getattr(stats, key)
            family.add_metric([name], _time_buckets(timing), timing.total)
    yield from (info, requests, *gauges.values(), batches, sizes, *times.values())


def _memory_families(snap: dict[str, Any]) -> Iterator[Metric]:
    """Resident memory: this process's, this machine's server processes' together, each
    model's and each worker process's (bytes; absent where the system cannot say)."""
    mb = 2**20
    memory = snap.get("memory", {})
    for key, name, doc in (
            ("process_rss_mb", "process_resident_memory_bytes", "Resident memory (RSS) of "
             "the server's own process"),
            ("total_pss_mb", "memory_bytes", "Memory of the server's processes on this "
             "machine together (PSS: shared pages counted once)")):
        if memory.get(key) is not None:
            yield _gauge(name, doc, memory[key] * mb)
    models = GaugeMetricFamily(f"{PREFIX}_model_memory_bytes", "What each model holds: its "
                               "worker processes' PSS, or what loading it added to the process",
                               labels=["model"])
    for name, entry in snap.get("models", {}).items():
        if entry.get("memory_mb") is not None:
            models.add_metric([name], entry["memory_mb"] * mb)
    workers = GaugeMetricFamily(f"{PREFIX}_worker_memory_bytes", "Each worker process's memory "
                                "(PSS)", labels=["model", "worker", "device"])
    for worker in snap.get("workers", []):
        pss = (worker.get("memory_mb") or {}).get("pss_mb")
        if pss is not None:
            workers.add_metric([str(worker.get("model", "")), str(worker["worker"]),
                                str(worker["device"])], pss * mb)
    yield from (models, workers)


def _worker_families(workers: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per-worker series (labels model, worker, device), and batches and engine time per
    device: over its workers and the processes they replaced, so that they never go back."""
    labels = ["model", "worker", "device"]
    up = GaugeMetricFamily(f"{PREFIX}_worker_up", "1 while the worker is serving", labels=labels)
    held = GaugeMetricFamily(f"{PREFIX}_worker_in_flight_requests", "Requests a worker holds",
                             labels=labels)
    restarts = CounterMetricFamily(f"{PREFIX}_worker_restarts", "Times the worker was replaced "
                                   "after dying", labels=labels)
    batches = CounterMetricFamily(f"{PREFIX}_worker_batches", "Batches the worker ran",
                                  labels=labels)
    busy = CounterMetricFamily(f"{PREFIX}_worker_engine_seconds", "Engine time of the worker's "
                               "batches", labels=labels)
    per_device: dict[str, list[float]] = {}
    for worker in workers:
        label = [str(worker.get("model", "")), str(worker["worker"]), str(worker["device"])]
        up.add_metric(label, int(worker["state"] == "serving"))
        held.add_metric(label, worker["in_flight"])
        restarts.add_metric(label, worker["restarts"])
        sums = per_device.setdefault(str(worker["device"]), [0, 0.0])
        if "batches" in worker:  # this query's answer, else its last one
            batches.add_metric(label, worker["batches"])
            busy.add_metric(label, worker["engine_seconds"])
            sums[0] += worker["batches"]
            sums[1] += worker["engine_seconds"]
        sums[0] += worker.get("earlier_batches", 0)  # the slot's replaced processes
        sums[1] += worker.get("earlier_engine_seconds", 0.0)
    device_batches = CounterMetricFamily(f"{PREFIX}_device_batches", "Batches run on each "
                                         "device (GPU), over its workers", labels=["device"])
    device_busy = CounterMetricFamily(f"{PREFIX}_device_engine_seconds", "Engine time on each "
                                      "device (GPU), over its workers", labels=["device"])
    for device, (n, seconds) in per_device.items():
        device_batches.add_metric([device], n)
        device_busy.add_metric([device], seconds)
    yield from (up, held, restarts, batches, busy, device_batches, device_busy)


def _executor_families(executors: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per executor (``--executors on``; labels model, device): up, restarts, batches, and
    batches holding the rows of several worker processes."""
    labels = ["model", "device"]
    up = GaugeMetricFamily(f"{PREFIX}_executor_up", "1 while the executor is serving",
                           labels=labels)
    restarts = CounterMetricFamily(f"{PREFIX}_executor_restarts", "Times the executor was "
                                   "replaced after dying", labels=labels)
    batches = CounterMetricFamily(f"{PREFIX}_executor_batches", "Batches the executor ran "
                                  "(since its last start)", labels=labels)
    shared = CounterMetricFamily(f"{PREFIX}_executor_shared_batches", "Batches holding the "
                                 "rows of several worker processes", labels=labels)
    for entry in executors:
        label = [str(entry.get("model", "")), str(entry["device"])]
        up.add_metric(label, int(entry["state"] == "serving"))
        restarts.add_metric(label, entry["restarts"])
        batches.add_metric(label, entry.get("batches", 0))
        shared.add_metric(label, entry.get("shared_batches", 0))
    if executors:
        yield from (up, restarts, batches, shared)


def _device_share(devices: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """Each device's busy fraction, where its engine knows it (``stats``' ``devices``)."""
    share = GaugeMetricFamily(f"{PREFIX}_device_busy_ratio", "Busy fraction of each device "
                              "over about the last 10 s, where its engine knows it (the sim "
                              "engine)", labels=["device"])
    for device, entry in devices.items():
        share.add_metric([device], entry["device_busy"])
    yield share


def _broker_families(brokers: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """The broker as a front end sees it (``--broker``), per model: docs/metrics.md."""
    if not brokers:
        return
    label = ["model"]
    gauges = (("up", "broker_up", "1 while this front end reaches Redis"),
              ("stream_length", "broker_stream_length", "Entries in the model's work stream: "
               "waiting, or taken by a worker and not yet answered"),
              ("pending", "broker_pending_entries", "Work entries taken by a worker and not yet "
               "acknowledged"),
              ("serving_workers", "broker_serving_workers", "Live workers holding the model "
               "whose heartbeat says they take work"),
              ("in_flight", "broker_in_flight", "Requests this front end put on the stream "
               "and has not answered yet"))
    counters = (("claims", "Work entries claimed from a worker that left them unanswered "
                 "(summed over the live workers)"),
                ("redeliveries", "Claimed work entries run again (live workers)"),
                ("duplicate_replies", "Second replies for requests a first reply had answered "
                 "(a claimed entry run twice; dropped)"),
                ("late_replies", "Replies for requests answered before them: deadline, "
                 "unavailable, client gone (dropped)"),
                ("unavailable", "Requests in flight answered 'unavailable' because Redis was "
                 "lost"),
                ("reconnects", "Times this front end reconnected to Redis"))
    for key, name, doc in gauges:
        family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=label)
        for model, broker in brokers.items():
            family.add_metric([model], int(broker[key]))
        yield family
    for key, doc in counters:
        family = CounterMetricFamily(f"{PREFIX}_broker_{key}", doc, labels=label)
        for model, broker in brokers.items():
            family.add_metric([model], broker[key])
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _info(snap: dict[str, Any]) -> GaugeMetricFamily:
    """What is served: the one model's name, or a repository's served names joined by ", ";
    the engine settings every model of one server shares (from the first that reports them)."""
    entries = snap.get("models", {})
    name = snap["model"]["name"] if "model" in snap else ", ".join(sorted(entries))
    engine = snap.get("engine") or next((e["engine"] for e in entries.values() if "engine" in e),
                                        {})
    labels = {"model": name, "engine": engine.get("type", ""),
              "device": engine.get("device", ""), "precision": engine.get("precision", ""),
              "sessions": str(snap["config"]["num_inference_sessions"]),
              "workers": str(snap["config"].get("workers", 1)),
              "max_batch_size": str(snap["config"]["max_batch_size"])}
    info = GaugeMetricFamily(f"{PREFIX}_info", "What is being served (value is always 1)",
                             labels=list(labels))
    info.add_metric(list(labels.values()), 1)
    return info


def _time_buckets(timing: Timing) -> list[tuple[str, int]]:
    cumulative, running = [], 0
    for bound, n in zip([*map(str, TIME_BUCKETS), "+Inf"], timing.buckets):
        running += n
        cumulative.append((bound, running))
    return cumulative


def _time_histogram(name: str, doc: str, timing: Timing) -> HistogramMetricFamily:
    return HistogramMetricFamily(f"{PREFIX}_{name}", doc, buckets=_time_buckets(timing),
                                 sum_value=timing.total)


def _batch_buckets(sizes: dict[str, int]) -> tuple[list[tuple[str, int]], int]:
    """Cumulative buckets of a batch-size histogram, and the sum of the sizes."""
    counts = {int(k): v for k, v in sizes.items()}
    buckets = [(str(b), sum(n for s, n in counts.items() if s <= b)) for b in BATCH_BUCKETS]
    buckets.append(("+Inf", sum(counts.values())))
    return buckets, sum(s * n for s, n in counts.items())


def _batch_histogram(sizes: dict[str, int]) -> HistogramMetricFamily:
    buckets, total = _batch_buckets(sizes)
    return HistogramMetricFamily(f"{PREFIX}_batch_size", "Requests per batch", buckets=buckets,
                                 sum_value=total)


class GpuProbe:
    """Per-GPU utilisation, memory and power through NVML; yields nothing without a GPU."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                            for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception as exc:  # noqa: BLE001 - no driver, no library, no GPU: no GPU series
            log.info("no NVIDIA GPU metrics: %s", exc)

    def collect(self) -> Iterator[Metric]:
        """GPU metric families, or nothing at all when there is no GPU."""
        if not self.handles:
            return
        nvml = self._nvml
        util = GaugeMetricFamily(f"{PREFIX}_gpu_utilization_ratio",
                                 "Fraction of time a kernel ran on the GPU (0-1)", labels=["gpu"])
        used = GaugeMetricFamily(f"{PREFIX}_gpu_memory_used_bytes", "GPU memory in use",
                                 labels=["gpu"])
        total = GaugeMetricFamily(f"{PREFIX}_gpu_memory_total_bytes", "GPU memory in all",
                                  labels=["gpu"])
        power = GaugeMetricFamily(f"{PREFIX}_gpu_power_watts", "GPU power draw", labels=["gpu"])
        for index, handle in enumerate(self.handles):
            label = [str(index)]
            util.add_metric(label, nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            used.add_metric(label, memory.used)
            total.add_metric(label, memory.total)
            power.add_metric(label, nvml.nvmlDeviceGetPowerUsage(handle) / 1000)
        yield from (util, used, total, power)


def serve_metrics(server: StatsSource, host: str, port: int) -> Any:
    """Serve ``/metrics`` for ``server`` on its own registry in a background thread.

    Returns:
        The HTTP server (``server_address`` gives the bound port; ``shutdown()`` stops it).
    """
    httpd, _thread = start_http_server(port, addr=host, registry=metrics_registry(server))
    return httpd


def metrics_registry(server: StatsSource) -> CollectorRegistry:
    """A registry of ``server``'s metrics alone (what ``/metrics`` serves, on either port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(server))
    return registry
