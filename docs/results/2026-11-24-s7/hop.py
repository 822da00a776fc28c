import sys, json, statistics
sys.path.insert(0, "/work/main")
from bench.scaleout import one_client_latency, pooled_p50s
from broker.local_server import RedisServer
from stress_test import load_pairs
if __name__ == "__main__":
    kinds = sys.argv[1].split(",")
    sets = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    pairs = load_pairs(None)
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as folder:
        rs = RedisServer(Path(folder)); rs.start()
        try:
          for kind in kinds:
            rows = one_client_latency(kind, "saved_models/qa", rs.url, pairs, 165, sets, [])
            a, b = pooled_p50s(rows)
            print(f"{kind}: pooled in-process {a:.2f} ms, redis {b:.2f} ms, diff {b - a:+.2f} ms", flush=True)
        finally:
            rs.stop()
