"""The GPU benchmark: raw engines per precision and batch, then the server, with NVML beside it.

    bash bench/gpu.sh                                   # a bare GPU box: install, prepare, run
    python bench/gpu.py --model_dir bench/models/bert-base-random
    python bench/gpu.py --model_dir saved_models --device cpu     # the dry run, on any machine

(1) Raw engine: each engine (onnx, pytorch) at each precision (fp32, fp16) called in-process on
    the request mix at batches 1-64, tokenization and decoding included (bench/bench.py's
    ``raw_ceiling``); an fp16 the model folder or device cannot run is skipped, and said.
(2) The server: a real server.py per engine, batching mode (auto, off) and layout (1 worker;
    one worker per GPU where there are several; ``--workers 1,2,4`` for others), with length
    buckets, closed-loop load at 1, 8, 32, 64 and 256 clients for ``--seconds`` each (``--load
    pipelined``: as many lean connections, ``--pipeline`` requests in flight each), with GPU
    utilisation, memory and power sampled through NVML during each level.
It prints the tables and the targets (server / best raw batch, auto / off at 64 clients, GPU
utilisation at saturation, fp16 / fp32 raw), and writes every figure as JSON and a PNG plot.
``--device cpu`` is a dry run: the same steps on the CPU, with small counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench import machine, raw_ceiling, raw_table  # noqa: E402
from bench.gpu_report import plot, targets_table  # noqa: E402
from bench.mix import load_pairs  # noqa: E402
from bench.nvml import NvmlSampler  # noqa: E402
from bench.pipeload import run_pipelined  # noqa: E402
from bench.runs import run_closed_loop  # noqa: E402
from bench.servers import qa_model_dir, start_server, stop_servers  # noqa: E402
from clients.blocking import Client  # noqa: E402
from engines.model_dir import ModelDirError  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402


def raw_rows(args: argparse.Namespace, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The raw engine per engine and precision; precisions an engine cannot run are skipped."""
    from engines import load_engine

    rows = []
    for kind in args.engines:
        for precision in args.precisions:
            probe = load_engine(kind, args.model_dir, device=args.device, precision=precision)
            runs, device = probe.precision, probe.device
            probe.close()
            if runs != precision:
                print(f"  raw {kind} {precision}: not run on {device} (the engine said why, "
                      f"above)", flush=True)
                continue
            for row in raw_ceiling(kind, args.model_dir, pairs, args.batch_sizes,
                                   args.raw_pairs, threads=0, device=args.device,
                                   precision=precision):
                rows.append({**row, "precision": precision, "device": device})
    return rows


def layouts(gpus: int, workers: list[int] | None = None) -> dict[str, list[str]]:
    """Server layouts: ``workers`` processes each (default: one; and one per GPU where there
    are several), spread over every GPU round-robin where there are several."""
    counts = workers or sorted({1, gpus} - {0})
    spread = ["--cuda_devices", ",".join(map(str, range(gpus)))] if gpus > 1 else []
    return {f"{n} worker{'s' if n > 1 else ''}": ["--workers", str(n), *(spread if n > 1 else [])]
            for n in counts}


def server_rows(args: argparse.Namespace, pairs: list[tuple[str, str]],
                sampler: NvmlSampler) -> list[dict[str, Any]]:
    """Every engine x layout x batching mode, at every client count."""
    rows = []
    for kind in args.engines:
        for layout, flags in layouts(sampler.gpus, args.workers).items():
            for mode in args.modes:
                extra = ["--device", args.device, "--precision", args.server_precision,
                         "--batching", mode, *flags, *args.server_args.split()]
                proc, port = start_server(kind, args.model_dir, args.sessions, extra)
                try:
                    with Client("127.0.0.1", port) as client:  # what it really runs
                        precision = client.stats(timeout=30)["engine"]["precision"]
                    for clients in args.concurrency:
                        row = _level(kind, layout, mode, port, clients, pairs, args, sampler)
                        rows.append({**row, "precision": precision})
                finally:
                    stop_servers(proc)
    return rows


def _level(kind: str, layout: str, mode: str, port: int, clients: int,
           pairs: list[tuple[str, str]], args: argparse.Namespace,
           sampler: NvmlSampler) -> dict[str, Any]:
    with sampler:
        result = _load(port, clients, pairs, args)
    row = {"engine": kind, "layout": layout, "batching": mode, "concurrency": clients,
           "load": args.load, **sampler.summary(),
           **{k: result[k] for k in ("throughput_rps", "p50_ms", "p99_ms", "errors", "ok")}}
    gpu = f", GPU {row['gpu_util_pct']:.0f}%" if "gpu_util_pct" in row else ""
    p50 = f"{row['p50_ms']:7.1f} ms" if row["p50_ms"] is not None else "      - ms"
    print(f"  server {kind} {layout} batching={mode} c={clients:>3}: "
          f"{row['throughput_rps']:8.1f} req/s, p50 {p50}{gpu}, "
          f"errors {row['errors'] or 0}", flush=True)
    return row


def _load(port: int, clients: int, pairs: list[tuple[str, str]],
          args: argparse.Namespace) -> dict[str, Any]:
    """One level of load: ``clients`` closed-loop stress_test.py clients, or (``--load
    pipelined``) as many lean connections with ``--pipeline`` requests in flight each."""
    if args.load == "closed":
        return run_closed_loop("127.0.0.1", port, clients=clients, requests_per_client=10**7,
                               pairs=pairs, warmup=4, progress=False, budget_s=args.seconds)
    processes = max(1, min(4, clients))
    run_pipelined("127.0.0.1", port, pairs, connections=clients, pipeline=args.pipeline,
                  processes=processes, seconds=min(2.0, args.seconds))  # warm-up
    result = run_pipelined("127.0.0.1", port, pairs, connections=clients,
                           pipeline=args.pipeline, processes=processes, seconds=args.seconds)
    return {**result, "p99_ms": None, "errors": sum(result["errors"].values())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; ``--device cpu`` shrinks the defaults to a dry run."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", default="bench/models/bert-base-random",
                   help="a folder from prepare_model.py (--random_bert_base --fp16)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a dry run)")
    p.add_argument("--engines", default="onnx,pytorch", help="engines, comma-separated")
    p.add_argument("--precisions", default="fp32,fp16", help="raw-engine precisions")
    p.add_argument("--server_precision", default="fp16", help="the servers' --precision")
    p.add_argument("--batch_sizes", default="1,2,4,8,16,32,64", help="raw-engine batch sizes")
    p.add_argument("--concurrency", default="1,8,32,64,256", help="server client counts")
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds of load per level (default 8; 1 for a dry run)")
    p.add_argument("--raw_pairs", type=int, default=None,
                   help="pairs per raw batch size, at least (default 256; 8 for a dry run)")
    p.add_argument("--sessions", type=int, default=2, help="server --num_inference_sessions")
    p.add_argument("--workers", default=None,
                   help="server layouts as --workers counts, e.g. 1,2 (default: 1, and one per "
                        "GPU where there are several)")
    p.add_argument("--modes", default="auto,off", help="server --batching modes")
    p.add_argument("--load", choices=("closed", "pipelined"), default="closed",
                   help="closed: stress_test.py clients, one request each in flight; "
                        "pipelined: bench/pipeload.py's lean connections, --pipeline each "
                        "(no latency figures), for the server's ceiling")
    p.add_argument("--pipeline", type=int, default=16,
                   help="requests in flight per connection with --load pipelined")
    p.add_argument("--server_args", default="--length_buckets 64,128,256,384",
                   help="more server.py flags, space-separated (length buckets: few shapes for "
                        "TensorRT)")
    p.add_argument("--data", default=None, help="request mix (default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--json", default="bench/results/gpu.json", help="where to write figures")
    p.add_argument("--plot", default="bench/results/gpu.png", help="where to draw them")
    args = p.parse_args(argv)
    try:
        args.model_dir = qa_model_dir(args.model_dir)  # a repository's qa model, or the folder
    except (ModelDirError, ValueError) as exc:
        p.error(str(exc))
    dry = args.device == "cpu"
    args.seconds = args.seconds if args.seconds is not None else (1.0 if dry else 8.0)
    args.raw_pairs = args.raw_pairs if args.raw_pairs is not None else (8 if dry else 256)
    for name in ("engines", "precisions", "modes"):
        setattr(args, name, getattr(args, name).split(","))
    args.workers = [int(x) for x in args.workers.split(",")] if args.workers else None
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run both parts, print the tables, write the JSON and the plot; exit status 0."""
    args = parse_args(argv)
    pairs = load_pairs(args.data)
    sampler = NvmlSampler()
    info = {**machine(), "gpus": sampler.gpus, "device": args.device}
    print(f"machine: {info}", flush=True)
    raw = raw_rows(args, pairs)
    server = server_rows(args, pairs, sampler)
    print("\n" + raw_table(raw) + "\n\n" + targets_table(raw, server), flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "argv": sys.argv[1:], "raw": raw,
                               "server": server}, indent=2) + "\n", encoding="utf-8")
    plot(args.plot, raw, server)
    print(f"\nfigures written to {out} and {args.plot}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
