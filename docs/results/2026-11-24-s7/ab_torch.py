"""PyTorch engine, eager vs traced, under bench/pipeload.py's lean pipelined load: req/s, CPU/request, mean batch."""
import sys, json
sys.path.insert(0, "/work/main")
from bench.servers import start_server, stop_servers
from bench.pipeload import run_pipelined
from bench.frontend import process_tree_cpu_s, answered
from client import Client
from stress_test import load_pairs

def one(model_dir, graph, workers, seconds, sessions=2):
    pairs = load_pairs(None)
    proc, port = start_server("pytorch", model_dir, max(1, sessions // workers),
                              ["--workers", str(workers), "--pytorch_graph", graph, "--threads_per_session", "1"])
    try:
        with Client("127.0.0.1", port) as c:
            for q, ctx in pairs[:16]:
                c.answer(q, ctx, timeout=120)
            before, cpu0 = answered(c), process_tree_cpu_s(proc.pid)
            st0 = c.stats(timeout=30)
            run = run_pipelined("127.0.0.1", port, pairs, connections=8, pipeline=16, processes=2, seconds=seconds)
            cpu = process_tree_cpu_s(proc.pid) - cpu0
            n = answered(c) - before
            st = c.stats(timeout=30)
    finally:
        stop_servers(proc)
    batches = st["batches"] - st0["batches"]
    reqs = sum(int(k) * v for k, v in st["batch_size_histogram"].items()) - sum(int(k) * v for k, v in st0["batch_size_histogram"].items())
    return {"graph": graph, "workers": workers, "rps": run["throughput_rps"], "cpu_us": 1e6 * cpu / max(1, n),
            "errors": run["errors"], "mean_batch": round(reqs / max(1, batches), 2), "engine_p50_ms": st["engine_time"].get("p50_ms"),
            "engine": st.get("engine", {}).get("description")}

if __name__ == "__main__":
    model_dir, seconds, rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    workers = [int(w) for w in sys.argv[4].split(",")] if len(sys.argv) > 4 else [1]
    for r in range(rounds):
        for w in workers:
            for g in (("eager", "traced") if r % 2 == 0 else ("traced", "eager")):
                print(json.dumps({"round": r + 1, **one(model_dir, g, w, seconds)}), flush=True)
