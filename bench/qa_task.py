"""The QA task's own CPU per request, beside the ``tokenizers``-alone floor (no server).

    python bench/qa_task.py --model_dir saved_models

On one thread and the shipped mix (bench/data/qa_pairs.jsonl): CPU microseconds per request of
``QATask.preprocess``, of ``collate`` (batches of ``--batch`` requests, per request), and of
``postprocess`` (standard-normal logits drawn beforehand), and the floor of bench/frontend.py
(``Tokenizer.encode`` with the server's windowing). ``preprocess`` minus the floor is the task's
own Python work on top of the encode. Figures are the best of ``--repeats`` rounds, to damp the
noise of a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.frontend import tokenizer_floor_us  # noqa: E402
from bench.mix import load_pairs  # noqa: E402
from bench.servers import qa_model_dir  # noqa: E402
from tasks.qa import QAConfig, QATask  # noqa: E402


def cpu_us_per_call(calls: list[Callable[[], object]], min_seconds: float) -> float:
    """CPU microseconds per call, cycling through ``calls`` for at least ``min_seconds``."""
    done, started = 0, time.process_time()
    while (spent := time.process_time() - started) < min_seconds:
        for call in calls:
            call()
        done += len(calls)
    return 1e6 * spent / done


def measure(task: QATask, pairs: list[tuple[str, str]], batch: int,
            min_seconds: float) -> dict[str, float]:
    """Preprocess, collate and postprocess CPU per request on ``pairs``."""
    features = [task.preprocess(q, c) for q, c in pairs]
    rng = np.random.default_rng(0)
    logits = [(rng.standard_normal((f.rows, f.max_len), dtype=np.float32),
               rng.standard_normal((f.rows, f.max_len), dtype=np.float32)) for f in features]
    batches = [features[i:i + batch] for i in range(0, len(features), batch)]
    pre = [lambda q=q, c=c: task.preprocess(q, c) for q, c in pairs]
    post = [lambda f=f, s=s, e=e: task.postprocess(f, s, e)
            for f, (s, e) in zip(features, logits)]
    coll = [lambda b=b: task.collate(b) for b in batches]
    return {"preprocess": cpu_us_per_call(pre, min_seconds),
            "collate": cpu_us_per_call(coll, min_seconds) * len(batches) / len(features),
            "postprocess": cpu_us_per_call(post, min_seconds)}


def main(argv: list[str] | None = None) -> int:
    """Print the best of ``--repeats`` rounds of each figure; exit status 0."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", default="saved_models", help="a prepared QA model folder, "
                   "or a repository holding one")
    p.add_argument("--data", help="request mix (default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--seconds", type=float, default=1.0, help="CPU seconds per figure and round")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the best of each is shown")
    p.add_argument("--batch", type=int, default=8, help="requests per collated batch")
    args = p.parse_args(argv)
    args.model_dir = qa_model_dir(args.model_dir)
    pairs = load_pairs(args.data)
    task = QATask.from_dir(args.model_dir, QAConfig())
    rounds = []
    for _ in range(args.repeats):
        figures = {"floor": tokenizer_floor_us(args.model_dir, pairs, min_seconds=args.seconds)}
        figures.update(measure(task, pairs, args.batch, args.seconds))
        rounds.append(figures)
    best = {name: min(r[name] for r in rounds) for name in rounds[0]}
    for name, value in best.items():
        print(f"{name:<12} {value:8.1f} us CPU per request")
    extra = best["preprocess"] - best["floor"] + best["collate"] + best["postprocess"]
    print(f"{'task extra':<12} {extra:8.1f} us (preprocess - floor + collate + postprocess)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
