"""Throwaway: the 1-client hop through Redis with the zero engine doing nothing, sleeping, or
streaming through memory (as a CPU model's weights do) in each run; alternating."""
import os, sys, tempfile
from pathlib import Path
sys.path.insert(0, os.getcwd())
from bench.scaleout import one_client_latency, pooled_p50s
from bench.mix import load_pairs
from broker.local_server import RedisServer

if __name__ == "__main__":
    rounds = int(sys.argv[1]); variants = sys.argv[2].split(",")
    pairs = load_pairs(None)
    with tempfile.TemporaryDirectory() as folder:
        rs = RedisServer(Path(folder)); rs.start()
        try:
            for n in range(rounds):
                for v in (variants if n % 2 == 0 else variants[::-1]):
                    os.environ["QA_ZERO_WORK"] = "" if v == "none" else v
                    rows = one_client_latency("zero", "saved_models/qa", rs.url, pairs, 165, 2, [])
                    a, b = pooled_p50s(rows)
                    print(f"RESULT round {n + 1} {v}: in-process {a:.2f} ms, redis {b:.2f} ms, hop {b - a:+.2f} ms", flush=True)
        finally:
            rs.stop()
