"""Seconds to load a PyTorch engine eager and traced (tracing plus the check against eager), best of 3."""
import sys, time, logging
sys.path.insert(0, "/work/main")
from engines import load_engine
for model_dir in sys.argv[1:]:
    load_engine("pytorch", model_dir, device="cpu", threads=1, graph="eager")  # imports, file cache
    best = {}
    for _ in range(3):
        for graph in ("eager", "traced"):
            t = time.perf_counter()
            e = load_engine("pytorch", model_dir, device="cpu", threads=1, graph=graph)
            best[graph] = min(best.get(graph, 1e9), time.perf_counter() - t)
            assert e.graph == graph
    print(f"{model_dir}: load eager {best['eager']:.2f} s, traced {best['traced']:.2f} s (+{best['traced'] - best['eager']:.2f} s for tracing and the check)", flush=True)
