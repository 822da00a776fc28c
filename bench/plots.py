"""Plots of stress_test.py runs: a sweep's percentiles and throughput, or one run's distribution.

``build_figure`` returns a matplotlib ``Figure`` made without pyplot (no global state, no display
backend), so tests can read its axes, title and line colours; ``plot_runs`` writes it to a PNG.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from bench.report import model_words

#: Latency percentile lines of a sweep, and their colours.
PERCENTILE_COLOURS = {50: "tab:blue", 90: "tab:orange", 99: "tab:red"}
#: Throughput's colour: no percentile line uses it.
THROUGHPUT_COLOUR = "tab:green"


def describe_server(runs: list[dict[str, Any]]) -> str:
    """Engine, sessions, model and date of the runs, from the server's ``stats`` op.

    Each run's ``server`` breakdown carries the config (``inference_engine_type``,
    ``num_inference_sessions``) and the model's name; the date is the first run's start.
    """
    date = str(runs[0].get("started", ""))[:10] or time.strftime("%Y-%m-%d")
    servers = {_server_words(run.get("server") or {}) for run in runs}
    return f"{' / '.join(sorted(servers))}, {date}"


def _server_words(server: dict[str, Any]) -> str:
    if not server:
        return "server unknown (no stats op)"
    sessions = server.get("sessions")
    plural = "" if sessions == 1 else "s"
    return (f"{server.get('engine_type') or '?'} engine, {sessions} session{plural}, "
            f"{model_words(server)}")


def build_figure(runs: list[dict[str, Any]]) -> Figure:
    """Several runs: latency p50/p90/p99 (left) and throughput (right) against clients at once
    (log scale) or offered rate. One run: its latency distribution and where the time goes."""
    fig = Figure(figsize=(11, 4.8))
    left, right = fig.subplots(1, 2)
    if len(runs) > 1:
        _plot_sweep(left, right, runs)
    else:
        _plot_single(left, right, runs[0])
    fig.suptitle(describe_server(runs))
    fig.tight_layout()
    return fig


def plot_runs(path: str | Path, runs: list[dict[str, Any]]) -> None:
    """Draw ``build_figure(runs)`` to a PNG file."""
    build_figure(runs).savefig(path, dpi=110)


def _plot_sweep(left: Any, right: Any, runs: list[dict[str, Any]]) -> None:
    closed = runs[0]["settings"]["mode"] == "closed"
    xs = [r["settings"]["clients" if closed else "rate"] for r in runs]
    label = "clients at once (log scale)" if closed else "offered rate (requests/s)"
    for q, colour in PERCENTILE_COLOURS.items():
        left.plot(xs, [r[f"p{q}_ms"] for r in runs], marker="o", color=colour, label=f"p{q}")
    left.set(xlabel=label, ylabel="latency (ms)", title="latency percentiles")
    left.legend()
    right.plot(xs, [r["throughput_rps"] for r in runs], marker="o", color=THROUGHPUT_COLOUR,
               label="throughput")
    right.set(xlabel=label, ylabel="requests/s", title="throughput")
    for axes in (left, right):
        if closed:
            axes.set_xscale("log")
            axes.xaxis.set_minor_formatter(NullFormatter())
        axes.set_xticks(xs, [f"{x:g}" for x in xs])
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)


def _plot_single(left: Any, right: Any, run: dict[str, Any]) -> None:
    labels = list(run["percentiles_ms"])
    left.plot(range(len(labels)), list(run["percentiles_ms"].values()), marker="o")
    left.set_xticks(range(len(labels)), [f"p{q}" for q in labels])
    left.set(ylabel="latency (ms)", title=f"latency distribution ({run['ok']} requests, "
                                          f"{run['throughput_rps']:.1f} requests/s)")
    left.grid(alpha=0.3)
    server = run["server"]
    bars = {"client latency": run["mean_ms"]}
    if server:
        bars.update({"server: admitted\nto reply": server["request_time"]["mean_ms"],
                     "server: queue": server["queue_time"]["mean_ms"],
                     "server: engine\nper batch": server["engine_time"]["mean_ms"]})
    right.bar(list(bars), list(bars.values()), color="tab:blue")
    right.set(ylabel="mean (ms)", title="where the time goes")
