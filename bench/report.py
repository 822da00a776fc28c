"""The text reports of stress_test.py: one run's summary, and a sweep's tables.

Pure functions over the plain dicts that ``run_closed_loop`` / ``run_open_loop`` return.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bench.figures import TIMINGS

#: Fewer successful requests than this and nearest-rank p99 is simply the maximum.
P99_SAMPLES = 100


def format_report(result: dict[str, Any]) -> str:
    """The human-readable summary of one run."""
    s, r = result["settings"], result
    if s["mode"] == "closed":
        head = (f"closed loop: {s['clients']} clients at once, {s['total_clients']} in all, "
                f"{s['requests_per_client']} requests each, pipeline {s['pipeline']}")
        if s.get("budget_s"):
            head += f", {s['budget_s']:g} s budget"
    else:
        limit = (f"{s['duration_s']:g} s" if math.isfinite(s["duration_s"])
                 else f"{s['max_requests']} requests")
        head = (f"open loop: Poisson arrivals at {s['rate']:g} requests/s for {limit} over "
                f"{s['connections']} connections")
    errors = ", ".join(f"{code} {n}" for code, n in r["errors"].items()) or "none"
    lines = [f"{head}, {s['processes']} processes"]
    if r.get("stopped_by") == "budget":
        lines.append(f"stopped by the {s['budget_s']:g} s budget after {r['clients_run']} of "
                     f"{s['total_clients']} clients; requests in flight then were answered and "
                     "counted")
    lines += [f"requests: {r['requests']}   ok: {r['ok']}   errors: {errors}",
              f"throughput: {r['throughput_rps']:.1f} requests/s over {r['wall_s']:.2f} s"]
    if r["ok"]:
        lines.append("latency ms: mean {mean_ms:.1f} ± {std_ms:.1f}   p50 {p50_ms:.1f}   "
                     "p90 {p90_ms:.1f}   p95 {p95_ms:.1f}   p99 {p99_ms:.1f}   max {max_ms:.1f}"
                     .format(**r))
    if 0 < r["ok"] < P99_SAMPLES:
        lines.append(f"note: {r['ok']} successful requests (fewer than {P99_SAMPLES}), so p99 is "
                     "the maximum" + (": raise --level_seconds" if s.get("budget_s") else ""))
    if "send_lag" in r:
        lines.append("send lag ms (sends behind schedule; latency counts from the schedule): mean "
                     "{mean_ms:.2f}   p99 {p99_ms:.2f}   max {max_ms:.2f}".format(**r["send_lag"]))
    return "\n".join(lines + _format_server(r["server"], r["mean_ms"]))


def _format_server(server: dict[str, Any], client_mean_ms: float) -> list[str]:
    if not server:
        return ["server: no stats (the server did not answer the stats op before or after the run)"]
    engine = server.get("engine", {})
    lines = [f"server: {server['sessions']} sessions, {engine.get('description', '?')}, max batch "
             f"{server['max_batch_size']}, {model_words(server)}"]
    if not server["request_time"]["count"]:
        return [*lines, "server ms: no request reached the engine"]
    q, e, t = (server[name]["mean_ms"] for name in TIMINGS)
    return [*lines,
            f"server ms: queue {q:.1f} + rest {t - q:.1f} = admitted-to-reply {t:.1f} per request;"
            f" engine {e:.1f} per batch; mean batch {server['mean_batch_size']:.2f} requests "
            f"({server['rows_per_batch']:.2f} windows); client, network and tokenizing "
            f"{client_mean_ms - t:.1f}"]


def model_words(server: dict[str, Any]) -> str:
    """The model a run loaded, in words: the served name (in a repository) and the model's own,
    and whether its answers mean anything."""
    model = server.get("model") or {}
    served = server.get("served_model")
    name = model.get("name", "?")
    words = f"model {served} ({name})" if served and served != name else f"model {name}"
    return words + ("" if model.get("meaningful", True) else ", answers not meaningful")


TABLES: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("latency mean ± std (ms)", lambda r: f"{r['mean_ms']:.1f} ± {r['std_ms']:.1f}"),
    ("latency p99 (ms)", lambda r: f"{r['p99_ms']:.1f}"),
    ("throughput (requests/s)", lambda r: f"{r['throughput_rps']:.1f}"),
)


def format_tables(runs: list[dict[str, Any]]) -> str:
    """The sweep tables: rows = the server's sessions setting, columns = clients at once."""
    cells = {(r["server"].get("sessions", "?"), r["settings"]["clients"]): r for r in runs}
    rows = sorted({key[0] for key in cells}, key=str)
    columns = sorted({key[1] for key in cells})
    out = []
    for title, cell in TABLES:
        grid = [["sessions \\ clients", *map(str, columns)]]
        grid += [[str(row), *(cell(cells[row, c]) if (row, c) in cells else "-" for c in columns)]
                 for row in rows]
        widths = [max(len(line[i]) for line in grid) for i in range(len(grid[0]))]
        lines = [" | ".join(text.rjust(w) for text, w in zip(line, widths)) for line in grid]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        out += [title, *lines, ""]
    return "\n".join(out).rstrip()
