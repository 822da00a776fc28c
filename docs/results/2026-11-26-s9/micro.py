"""Throwaway: one-thread timings behind the ninth session's notes (run from a tree's root).

    python micro.py encode     # encode with offsets against encode_batch_fast (ids only)
    python micro.py steps      # preprocess, and postprocess of fresh features
    python micro.py overhead   # the fast path's ASCII check; WorkQueue put + take_batch
"""
import os, random, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np
from stress_test import load_pairs
from tasks.encoding import release_gil
from tasks.qa import QAConfig, QATask

release_gil(False)  # as in a worker
PAIRS = load_pairs(None)
TASK = QATask.from_dir("saved_models/qa", QAConfig())


def per_pair(fn, secs=1.5):
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < secs:
        for q, c in PAIRS:
            fn(q, c)
        n += len(PAIRS)
    return 1e6 * (time.process_time() - t0) / n


def encode():
    b = TASK._fast._backend
    for _ in range(3):
        print("encode() x2, offsets  %.1f us/pair" % per_pair(lambda q, c: [
            b.encode(t, add_special_tokens=False).ids for t in (q.lower(), c.lower())]))
        print("encode_batch_fast     %.1f us/pair" % per_pair(lambda q, c: [
            e.ids for e in b.encode_batch_fast([q.lower(), c.lower()], add_special_tokens=False)]))


def steps():
    rng = np.random.default_rng(0)
    feats = [TASK.preprocess(q, c) for q, c in PAIRS]
    logits = [(rng.standard_normal((f.rows, f.max_len), dtype=np.float32),
               rng.standard_normal((f.rows, f.max_len), dtype=np.float32)) for f in feats]
    for _ in range(2):
        print("preprocess %.1f us/request" % per_pair(lambda q, c: TASK.preprocess(q, c)))
        spent, n = 0.0, 0
        while spent < 1.5:
            fresh = [TASK.preprocess(q, c) for q, c in PAIRS]
            t0 = time.process_time()
            for f, (s, e) in zip(fresh, logits):
                TASK.postprocess(f, s, e)
            spent += time.process_time() - t0
            n += len(PAIRS)
        print("postprocess (fresh features) %.1f us/request" % (1e6 * spent / n))


def overhead():
    from scheduling.cost_model import CostModel
    from scheduling.planner import BatchPolicy
    from scheduling.queue import WorkItem, WorkQueue
    print("fast path's check %.1f us/request" % per_pair(lambda q, c: TASK._fast.takes(q, c)))
    cost = CostModel()  # the zero engine's warm-up table, as a worker's stats gave it
    for shape, ms in {"1x64": 0.0035, "1x384": 0.0019, "2x64": 0.0026, "2x384": 0.0021,
                      "4x64": 0.0024, "4x384": 0.0021, "8x64": 0.0026, "8x384": 0.0022,
                      "16x64": 0.0022, "16x384": 0.0024, "32x64": 0.0020, "32x384": 0.0033}.items():
        rows, length = map(int, shape.split("x"))
        cost.observe(rows, length, ms / 1000, warmup=True)
    policy = BatchPolicy(mode="auto", max_items=32, max_tokens=16384, max_delay_s=0.002,
                         lookahead=128, cost=cost)
    random.seed(0)
    items = [WorkItem(features=None, respond=lambda r, e: None, rows=random.choice([1, 1, 2]),
                      length=random.choice([40, 130, 384, 384])) for _ in range(64)]
    queue, n, t0 = WorkQueue(10000), 0, time.process_time()
    while time.process_time() - t0 < 1.5:
        for item in items:
            item.queued = item.answered = False
            queue.put(item)
        while len(queue):
            batch = queue.take_batch(policy)
            queue.done()
            n += len(batch)
    print("WorkQueue put + take_batch %.1f us/request" % (1e6 * (time.process_time() - t0) / n))


if __name__ == "__main__":
    {"encode": encode, "steps": steps, "overhead": overhead}[sys.argv[1]]()
