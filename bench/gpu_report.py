"""Tables, targets and the plot of bench/gpu.py (figures in, text and a PNG out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Issue 11's targets on one GPU.
SERVER_VS_RAW, AUTO_VS_OFF, GPU_UTIL_PCT, FP16_VS_FP32 = 0.9, 8.0, 80.0, 2.0


def best_raw(raw: list[dict[str, Any]], engine: str, precision: str) -> float | None:
    """The engine's best raw pairs/s at ``precision``, over batch sizes (None if not run)."""
    rates = [r["pairs_per_s"] for r in raw if r["engine"] == engine and r["precision"] == precision]
    return max(rates) if rates else None


def server_table(raw: list[dict[str, Any]], server: list[dict[str, Any]]) -> str:
    """Every server level against the raw engine's best batch at the server's precision."""
    lines = ["| engine | layout | batching | clients | req/s | / best raw | p50 ms | p99 ms | "
             "GPU util | GPU MiB | W |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in server:
        best = best_raw(raw, row["engine"], row["precision"]) or best_raw(raw, row["engine"],
                                                                          "fp32")
        ratio = f"{row['throughput_rps'] / best:.2f}" if best else "-"
        gpu = (f"{row['gpu_util_pct']:.0f}% | {row['gpu_memory_mib']:.0f} | "
               f"{row['gpu_power_w']:.0f}") if "gpu_util_pct" in row else "- | - | -"
        latency = " | ".join("-" if row[k] is None else f"{row[k]:.1f}"
                             for k in ("p50_ms", "p99_ms"))
        lines.append(f"| {row['engine']} | {row['layout']} | {row['batching']} | "
                     f"{row['concurrency']} | {row['throughput_rps']:.1f} | {ratio} | "
                     f"{latency} | {gpu} |")
    return "\n".join(lines)


def targets(raw: list[dict[str, Any]], server: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target per engine: the figure, the goal, and whether it is met (None: not measured)."""
    found = []
    for engine in dict.fromkeys(r["engine"] for r in server):
        mine = [r for r in server if r["engine"] == engine and r["layout"] == "1 worker"]
        auto = [r for r in mine if r["batching"] == "auto"]
        best = best_raw(raw, engine, auto[0]["precision"]) if auto else None
        best = best or best_raw(raw, engine, "fp32")
        peak = max((r["throughput_rps"] for r in auto), default=None)
        found.append(_target(engine, "server / best raw batch", peak / best
                             if peak and best else None, SERVER_VS_RAW))
        at64 = {r["batching"]: r["throughput_rps"] for r in mine if r["concurrency"] == 64}
        found.append(_target(engine, "auto / off at 64 clients", at64["auto"] / at64["off"]
                             if {"auto", "off"} <= set(at64) and at64["off"] else None,
                             AUTO_VS_OFF))
        utils = [r["gpu_util_pct"] for r in auto if "gpu_util_pct" in r]
        found.append(_target(engine, "GPU utilisation at saturation, %",
                             max(utils) if utils else None, GPU_UTIL_PCT))
        half, full = best_raw(raw, engine, "fp16"), best_raw(raw, engine, "fp32")
        found.append(_target(engine, "fp16 / fp32, raw", half / full if half and full else None,
                             FP16_VS_FP32))
    return found


def _target(engine: str, name: str, value: float | None, goal: float) -> dict[str, Any]:
    return {"engine": engine, "target": name, "value": value, "goal": goal,
            "met": None if value is None else value >= goal}


def layouts_table(server: list[dict[str, Any]]) -> str:
    """Each engine's peak requests/s per layout (batching auto), against one worker's."""
    lines = ["| engine | layout | peak req/s | / 1 worker |", "|---|---|---:|---:|"]
    for engine in dict.fromkeys(r["engine"] for r in server):
        peaks = {}
        for r in server:
            if r["engine"] == engine and r["batching"] == "auto":
                peaks[r["layout"]] = max(peaks.get(r["layout"], 0.0), r["throughput_rps"])
        one = peaks.get("1 worker")
        for layout, peak in peaks.items():
            ratio = f"{peak / one:.2f}" if one else "-"
            lines.append(f"| {engine} | {layout} | {peak:.1f} | {ratio} |")
    return "\n".join(lines)


def targets_table(raw: list[dict[str, Any]], server: list[dict[str, Any]]) -> str:
    """The server table, the layouts' peaks, then the targets with what was measured."""
    lines = [server_table(raw, server), "", layouts_table(server), "",
             "| engine | target | measured | goal | met |",
             "|---|---|---:|---:|---|"]
    for t in targets(raw, server):
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}"
        met = {None: "-", True: "yes", False: "no"}[t["met"]]
        lines.append(f"| {t['engine']} | {t['target']} | {value} | {t['goal']:g} | {met} |")
    return "\n".join(lines)


def plot(path: str | Path, raw: list[dict[str, Any]], server: list[dict[str, Any]]) -> None:
    """Requests/s per client count (raw bests as dashed lines) and GPU utilisation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in dict.fromkeys((r["engine"], r["layout"], r["batching"]) for r in server):
        rows = [r for r in server if (r["engine"], r["layout"], r["batching"]) == key]
        clients = [r["concurrency"] for r in rows]
        left.plot(clients, [r["throughput_rps"] for r in rows], marker="o", label=" ".join(key))
        if all("gpu_util_pct" in r for r in rows):
            right.plot(clients, [r["gpu_util_pct"] for r in rows], marker="o",
                       label=" ".join(key))
    bests = [(engine, precision, best) for engine in dict.fromkeys(r["engine"] for r in raw)
             for precision in ("fp32", "fp16")
             if (best := best_raw(raw, engine, precision)) is not None]
    for n, (engine, precision, best) in enumerate(bests):
        left.axhline(best, linestyle="--", linewidth=1, color=f"C{(n + 5) % 10}",
                     label=f"raw {engine} {precision}, best batch")
    left.set(xscale="log", xlabel="clients", ylabel="requests/s", title="throughput")
    right.set(xscale="log", xlabel="clients", ylabel="GPU utilisation %", ylim=(0, 100),
              title="GPU (NVML)" if right.lines else "GPU: none sampled")
    left.legend(fontsize=7)
    if right.lines:
        right.legend(fontsize=7)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
