"""Throwaway: the 1-client hop through Redis under each --cpu_scheduling, alternating."""
import os, sys, tempfile
from pathlib import Path
sys.path.insert(0, os.getcwd())
from bench.scaleout import one_client_latency, pooled_p50s
from bench.mix import load_pairs
from broker.local_server import RedisServer

if __name__ == "__main__":
    kinds, rounds = sys.argv[1].split(","), int(sys.argv[2])
    pairs = load_pairs(None)
    with tempfile.TemporaryDirectory() as folder:
        rs = RedisServer(Path(folder)); rs.start()
        try:
            for n in range(rounds):
                for kind in kinds:
                    for policy in (("batch", "normal") if n % 2 == 0 else ("normal", "batch")):
                        rows = one_client_latency(kind, "saved_models", rs.url, pairs, 165, 2,
                                                  ["--cpu_scheduling", policy])
                        a, b = pooled_p50s(rows)
                        print(f"RESULT round {n + 1} {kind} {policy}: in-process {a:.2f} ms, redis {b:.2f} ms, hop {b - a:+.2f} ms", flush=True)
        finally:
            rs.stop()
