"""The GIL convoy: a PyTorch forward of many small operators, alone and beside one thread that
runs Python, at several switch intervals (docs/benchmarks.md, sixth session).

    .venv/bin/python docs/results/2026-11-24-h100-b/gil_convoy.py
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import torch
from transformers import BertConfig, BertForQuestionAnswering

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


def spin(stop: threading.Event) -> None:
    """Run Python until ``stop`` is set."""
    while not stop.is_set():
        pass


def main() -> None:
    forward = tiny_forward()
    for _ in range(20):
        forward()
    for interval in INTERVALS_S:
        sys.setswitchinterval(interval)
        alone = timed(forward, 50)
        stop = threading.Event()
        busy = threading.Thread(target=spin, args=(stop,))
        busy.start()
        beside = timed(forward, 20)
        stop.set()
        busy.join()
        print(f"switch interval {interval * 1e3:g} ms: alone {alone[0]:.2f} / {alone[1]:.2f} ms, "
              f"beside a busy thread {beside[0]:.2f} / {beside[1]:.2f} ms (wall / CPU)")


if __name__ == "__main__":
    main()
