"""The ONNX fp16 GPU server under the lean pipelined load (bench/pipeload.py), 1-8 workers, and
how long each takes to stop after SIGTERM: table 3 of docs/benchmarks.md's first GPU run.

The ad-hoc script that ran there (only reformatted since), from the repository root:
    python docs/results/2026-11-24-h100/pipegpu.py 1,4,8
"""

import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
from bench.bench import start_server, stop_servers  # noqa: E402
from bench.gpu import NvmlSampler  # noqa: E402
from bench.pipeload import run_pipelined  # noqa: E402
from stress_test import load_pairs  # noqa: E402

MODEL = "saved_models/bert-base-random"


def main() -> None:
    """One server per --workers count: warm-up, 6 s of load, then SIGTERM, timed."""
    pairs = load_pairs(None)
    rows = []
    for n in [int(x) for x in sys.argv[1].split(",")]:
        proc, port = start_server("onnx", MODEL, 2, ["--device", "cuda", "--precision", "fp16",
                                  "--workers", str(n), "--length_buckets", "64,128,256,384"])
        row: dict = {"workers": None}
        try:
            run_pipelined("127.0.0.1", port, pairs, connections=16, pipeline=8, processes=2,
                          seconds=2)
            sampler = NvmlSampler()
            with sampler:
                r = run_pipelined("127.0.0.1", port, pairs, connections=64, pipeline=16,
                                  processes=4, seconds=6)
            row = {"workers": n, **{k: r[k] for k in ("throughput_rps", "errors", "load_cpu_s")},
                   **sampler.summary()}
        finally:
            t = time.monotonic()
            stop_servers(proc, timeout_s=30)
            row["stop_s"] = time.monotonic() - t
            row["exit"] = proc.returncode
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.environ.get("OUT", "/tmp") + "/pipegpu.json", "w") as out:
        json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
