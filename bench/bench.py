"""The benchmark: each model's raw-engine ceiling vs. the server, in one run, on one machine.

    python bench/bench.py --model_dir saved_models                # every model of the repository
    python bench/bench.py --model_dir saved_models/qa saved_models/embed --engines onnx
    python bench/bench.py --model_dir saved_models --task embed --concurrency 1,8 --quick

``--model_dir`` names one or more prepared model folders or repositories of them (as server.py
reads its own ``--model_dir``); every model found is measured, with the requests of its task
(serving.json's ``task``; ``--task`` keeps only the models of one task). The request mix
(``bench/data/qa_pairs.jsonl``) gives qa its question/context pairs and embed and classify their
texts (its questions and contexts, as stress_test.py sends them).

(1) Raw-engine ceiling, per model (bench/raw.py): the task built as the server builds it and its
    engine called directly in-process with batches of 1, 2, 4, ... 64 requests, features,
    engine and answers included; requests/s (pairs/s for qa) for each batch size. Also the
    server's own layout without the server: --sessions engines in as many threads, batch 1.
    The best of these is the ceiling the server is held to.
(2) The server: one real `server.py` process per --model_dir and --batching mode, under
    stress_test.py's closed-loop load of each model's own requests at each concurrency. At each
    concurrency every model and mode runs in turn, in alternating order, so that drift on a
    shared machine favours none.
It prints, per model, each server figure divided by that model's best raw-engine figure, and
p50 at concurrency 1 minus the raw batch-1 latency, and writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.figures import median_rows  # noqa: E402
from bench.loadgen import Item  # noqa: E402
from bench.mix import TASKS, load_mix  # noqa: E402
from bench.raw import raw_ceiling, raw_parallel, raw_row  # noqa: E402
from bench.runs import run_closed_loop  # noqa: E402
from bench.servers import start_server, stop_servers  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402
from tasks.qa_answers import span_search  # noqa: E402

# raw_ceiling, raw_parallel and raw_row live in bench/raw.py, start_server and stop_servers in
# bench/servers.py; bench/gpu.py and bench/scaleout.py import the raw ones from here.
__all__ = ["Target", "find_targets", "machine", "raw_ceiling", "raw_parallel", "raw_row",
           "raw_table", "ratios", "summary_table"]


@dataclass(frozen=True)
class Target:
    """One measured model.

    Attributes:
        name: Its name on the server (its folder's name).
        folder: Its prepared model folder.
        task: serving.json's task (``qa``, ``embed``, ``classify``).
        op: The op of its requests.
        served: The ``--model_dir`` its server serves (the folder, or its repository).
        named: Its server serves several models, so its requests name it.
    """

    name: str
    folder: str
    task: str
    op: str
    served: str
    named: bool


def find_targets(model_dirs: list[str], task: str | None = None) -> list[Target]:
    """The models in ``model_dirs`` (each a model folder or a repository), of ``task`` if given.

    Raises:
        ModelDirError: a folder holds no prepared model.
        ValueError: no model of ``task``, a task the benchmark has no requests for, or two
            models of the same name.
    """
    from engines.model_dir import find_models, load_model_info
    from tasks import task_class

    targets = []
    for served in model_dirs:
        found = find_models(served)
        for name, folder in found:
            info = load_model_info(folder)
            if task is not None and info.task != task:
                continue
            if info.task not in TASKS:
                raise ValueError(f"{folder}: no request mix for task {info.task!r} (the "
                                 f"benchmark knows {', '.join(TASKS)}); leave it out with --task")
            targets.append(Target(name, str(folder), info.task, task_class(info.task).op,
                                  served, len(found) > 1))
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"two models of the same name in {model_dirs}: {names}")
    if not targets:
        raise ValueError(f"no {task} model in {', '.join(model_dirs)}")
    return targets


def raw_runs(targets: list[Target], mixes: dict[str, list[Item]], kinds: list[str],
             args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every model's raw-engine figures, for each engine: batch sizes, then the session layout."""
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    threads = args.raw_threads or os.cpu_count() or 1
    raw = []
    for target in targets:
        for kind in kinds:
            raw += raw_ceiling(kind, target.folder, mixes[target.name], sizes, args.raw_pairs,
                               threads, device=args.device, precision=args.precision,
                               model=target.name)
            if args.sessions > 1:
                raw.append(raw_parallel(kind, target.folder, mixes[target.name], args.sessions,
                                        args.raw_pairs, model=target.name, device=args.device,
                                        precision=args.precision))
    return raw


def server_runs(kind: str, targets: list[Target], mixes: dict[str, list[Item]],
                levels: list[int], sessions: int, min_requests: int, extra: list[str],
                modes: list[str], best: dict[tuple[str, str], float] | None = None,
                rounds: int = 1) -> list[dict[str, Any]]:
    """Closed-loop load at each concurrency, for every model, on one server process per
    ``--model_dir`` and batching mode.

    A mode may carry more server flags after a colon (``auto:--workers 2``), and another
    checkout's server.py after an at sign (``auto@../base``): servers of different layouts or
    commits then run side by side. All servers start first (an idle one costs nothing); at each
    level every (model, mode) runs ``rounds`` times, in an order that reverses from one pass to
    the next, so that drift on a shared machine favours none; each figure is the median of its
    rounds (``bench.figures.median_rows``). ``best``: the best raw figure per (model, engine),
    to print each figure against."""
    servers: dict[tuple[str, str], tuple[Any, int]] = {}
    runs = [(target, mode) for target in targets for mode in modes]
    rows = []
    try:
        for served in dict.fromkeys(t.served for t in targets):
            for mode in modes:
                flags, root = _mode_flags(mode)
                servers[served, mode] = start_server(kind, str(Path(served).resolve()), sessions,
                                                     [*extra, *flags], root=root)
        passes = [clients for clients in levels for _ in range(rounds)]
        for n, clients in enumerate(passes):
            for target, mode in runs if n % 2 == 0 else runs[::-1]:
                rows.append(_one_level(kind, target, mode, servers[target.served, mode][1],
                                       clients, mixes[target.name], sessions, min_requests,
                                       (best or {}).get((target.name, kind))))
    finally:
        stop_servers(*(proc for proc, _ in servers.values()))
    return median_rows(rows)


def _mode_flags(mode: str) -> tuple[list[str], Path]:
    """``auto`` -> ``--batching auto`` in this checkout; ``auto:--workers 2`` -> that plus
    ``--workers 2``; ``auto@DIR`` -> ``--batching auto`` in the checkout at DIR."""
    batching, _, flags = mode.partition(":")
    batching, _, root = batching.partition("@")
    return ["--batching", batching, *flags.split()], Path(root).resolve() if root else ROOT


def _one_level(kind: str, target: Target, mode: str, port: int, clients: int,
               mix: list[Item], sessions: int, min_requests: int,
               best: float | None) -> dict[str, Any]:
    per_client = max(4, -(-min_requests // clients))
    result = run_closed_loop("127.0.0.1", port, clients=clients, requests_per_client=per_client,
                             pairs=mix, warmup=2 * sessions, progress=False, op=target.op,
                             model=target.name if target.named else None)
    result.update(model=target.name, task=target.task, engine=kind, concurrency=clients,
                  batching=mode)
    ratio = f", / best raw {result['throughput_rps'] / best:.2f}" if best else ""
    print(f"  server {target.name} ({target.task}) {kind} batching={mode} c={clients:>3}: "
          f"{result['throughput_rps']:7.1f} req/s{ratio}, p50 {result['p50_ms']:7.1f} ms, "
          f"p99 {result['p99_ms']:7.1f} ms, errors {result['errors'] or 0}", flush=True)
    return result


def best_raw(raw: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The best raw-engine row of each (model, engine)."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in raw:
        key = (row.get("model", ""), row["engine"])
        if key not in best or row["pairs_per_s"] > best[key]["pairs_per_s"]:
            best[key] = row
    return best


def ratios(raw: list[dict[str, Any]], server: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each server figure against the best raw figure of its model and engine; ``saturation``
    marks the highest concurrency of its model, engine and mode."""
    best = best_raw(raw)
    top: dict[tuple[str, str, str], int] = {}
    for row in server:
        key = (row["model"], row["engine"], row["batching"])
        top[key] = max(top.get(key, 0), row["concurrency"])
    out = []
    for row in server:
        ceiling = best[row["model"], row["engine"]]
        out.append({"model": row["model"], "task": row["task"], "engine": row["engine"],
                    "batching": row["batching"], "concurrency": row["concurrency"],
                    "req_s": row["throughput_rps"], "best_raw": ceiling["pairs_per_s"],
                    "best_raw_layout": ceiling["layout"],
                    "best_raw_batch": ceiling["batch_size"],
                    "ratio": row["throughput_rps"] / ceiling["pairs_per_s"],
                    "saturation": row["concurrency"] == top[row["model"], row["engine"],
                                                            row["batching"]]})
    return out


def summary_table(raw: list[dict[str, Any]], server: list[dict[str, Any]]) -> str:
    """The one table: server figures against the best raw-engine figure of the same engine."""
    lines = ["| engine | batching | clients | req/s | best raw | / best raw | p50 ms | p99 ms | "
             "p99/p50 | mean batch |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    best = best_raw(raw)
    for row in server:
        ceiling = best[row.get("model", ""), row["engine"]]["pairs_per_s"]
        batch = row.get("server", {}).get("mean_batch_size", float("nan"))
        lines.append(f"| {row['engine']} | {row['batching']} | {row['concurrency']} | "
                     f"{row['throughput_rps']:.1f} | {ceiling:.1f} | "
                     f"{row['throughput_rps'] / ceiling:.2f} | {row['p50_ms']:.1f} | "
                     f"{row['p99_ms']:.1f} | {row['p99_ms'] / row['p50_ms']:.2f} | {batch:.2f} |")
    lines += ["", "| engine | best raw req/s (layout, batch) | raw batch-1 p50 ms | server p50 "
              "at 1 client ms | difference ms |", "|---|---|---:|---:|---:|"]
    for kind in dict.fromkeys(r["engine"] for r in raw):
        mine = [r for r in raw if r["engine"] == kind]
        top = max(mine, key=lambda r: r["pairs_per_s"])
        one = next((r for r in mine if r["batch_size"] == 1 and "parallel" not in r["layout"]),
                   None)
        lone = next((s for s in server if s["engine"] == kind and s["concurrency"] == 1
                     and s["batching"] == server[0]["batching"]), None)
        if one and lone:
            lines.append(f"| {kind} | {top['pairs_per_s']:.1f} ({top['layout']}, "
                         f"{top['batch_size']}) | {one['p50_batch_ms']:.1f} | {lone['p50_ms']:.1f} "
                         f"| {lone['p50_ms'] - one['p50_batch_ms']:+.1f} |")
    return "\n".join(lines)


def batching_table(server: list[dict[str, Any]], base: str = "off") -> str:
    """Each batching mode's throughput and p50 against ``base`` at the same engine and clients."""
    lines = [f"| engine | batching | clients | req/s vs {base} | p50 vs {base} |",
             "|---|---|---:|---:|---:|"]
    for row in server:
        ref = next((r for r in server if r["batching"] == base and r["engine"] == row["engine"]
                    and r["concurrency"] == row["concurrency"]), None)
        if ref is None or row is ref:
            continue
        lines.append(f"| {row['engine']} | {row['batching']} | {row['concurrency']} | "
                     f"{row['throughput_rps'] / ref['throughput_rps']:.2f} | "
                     f"{row['p50_ms'] / ref['p50_ms']:.2f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def raw_table(raw: list[dict[str, Any]]) -> str:
    """Raw-engine ceiling per batch size."""
    lines = ["| engine | layout | batch | req/s | mean ms per batch | p50 ms per batch |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['engine']} | {r['layout']} | {r['batch_size']} | {r['pairs_per_s']:.1f} | "
              f"{r['batch_latency_ms']:.1f} | {r['p50_batch_ms']:.1f} |" for r in raw]
    return "\n".join(lines)


def report(targets: list[Target], raw: list[dict[str, Any]],
           server: list[dict[str, Any]]) -> str:
    """Every model's tables, one model after another (figures of different tasks never mix)."""
    parts = []
    for target in targets:
        mine = [r for r in raw if r.get("model") == target.name]
        served = [r for r in server if r["model"] == target.name]
        parts += [f"## {target.name} ({target.task}, {target.folder})", "", raw_table(mine), "",
                  summary_table(mine, served)]
        modes = list(dict.fromkeys(r["batching"] for r in served))
        base = "off" if "off" in modes else modes[0]
        if batching := batching_table(served, base):
            parts += ["", batching]
        parts.append("")
    return "\n".join(parts)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
    import onnxruntime
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "commit": commit, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "qa_span_search": span_search()}  # the servers it starts inherit tree and environment


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", nargs="+", default=["saved_models"],
                   help="prepared model folders or repositories of them (prepare_model.py); "
                        "one server each")
    p.add_argument("--task", choices=TASKS, default=None,
                   help="measure only the models of this task (default: every model found)")
    p.add_argument("--texts_per_request", type=int, default=1, help="embed: texts per request")
    p.add_argument("--engines", default="onnx,pytorch", help="engines to measure, comma-separated")
    p.add_argument("--batch_sizes", default="1,2,4,8,16,32,64",
                   help="raw-engine batch sizes, comma-separated")
    p.add_argument("--concurrency", default="1,8,32,64",
                   help="server client counts, comma-separated")
    p.add_argument("--sessions", type=int, default=2, help="server --num_inference_sessions")
    p.add_argument("--batching", default="auto,off",
                   help="server --batching modes to run side by side (first is the default's); "
                   "a mode may add server flags after a colon: 'auto,auto:--workers 2', and "
                   "another checkout's server.py after an at sign: 'auto,auto@../base'")
    p.add_argument("--raw_pairs", type=int, default=128, help="requests per batch size (at least)")
    p.add_argument("--server_requests", type=int, default=256, help="requests per concurrency")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each server at each concurrency, alternating; medians reported")
    p.add_argument("--raw_threads", type=int, default=0, help="engine threads (0: all cores)")
    p.add_argument("--server_args", default="", help="extra server.py flags, space-separated")
    p.add_argument("--device", default="auto", help="the raw engines' and servers' --device "
                   "(auto, cpu, cuda, cuda:N)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"),
                   help="the raw engines' and servers' --precision")
    p.add_argument("--data", default=None, help="request mix (default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--json", default="bench/results/latest.json", help="where to write figures")
    p.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    return p.parse_args(argv)


def server_flags(args: argparse.Namespace) -> list[str]:
    """The servers' extra flags: ``--server_args``, then the device and precision the raw
    engines ran (unless left at their defaults)."""
    flags = args.server_args.split()
    if args.device != "auto":
        flags += ["--device", args.device]
    if args.precision != "fp32":
        flags += ["--precision", args.precision]
    return flags


def main(argv: list[str] | None = None) -> int:
    """Run everything and print the tables; returns the exit status (2: no model to measure)."""
    args = parse_args(argv)
    if args.rounds < 1:
        print("bench: --rounds takes 1 or more", file=sys.stderr)
        return 2
    if args.quick:
        args.raw_pairs, args.server_requests = 8, 16
    try:
        targets = find_targets(args.model_dir, args.task)
        mixes = {t.name: load_mix(t.task, args.data, args.texts_per_request
                                  if t.task == "embed" else 1) for t in targets}
    except (OSError, ValueError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    kinds = args.engines.split(",")
    levels = [int(x) for x in args.concurrency.split(",")]
    info = machine()
    print(f"machine: {info}", flush=True)
    print("models: " + ", ".join(f"{t.name} ({t.task}, server --model_dir {t.served})"
                                 for t in targets), flush=True)
    raw = raw_runs(targets, mixes, kinds, args)
    best = {key: row["pairs_per_s"] for key, row in best_raw(raw).items()}
    modes = args.batching.split(",")
    server = [row for kind in kinds for row in
              server_runs(kind, targets, mixes, levels, args.sessions, args.server_requests,
                          server_flags(args), modes, best, args.rounds)]
    order = [t.name for t in targets]
    server.sort(key=lambda r: (order.index(r["model"]), kinds.index(r["engine"]),
                               modes.index(r["batching"]), r["concurrency"]))
    print("\n" + report(targets, raw, server))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "args": vars(args),
                               "models": [asdict(t) for t in targets], "raw": raw,
                               "server": server, "ratios": ratios(raw, server)}, indent=2))
    print(f"figures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
