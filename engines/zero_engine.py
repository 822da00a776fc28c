"""An engine that costs nothing: random outputs of the right shape, at once.

The shapes follow the model folder's task: QA logits ``[rows, seq_len]`` per output, embeddings
``[rows, embedding_dim]`` of unit length, class logits ``[rows, len(labels)]``; a plug-in task's
outputs get ``[rows, seq_len]``.

With it, everything the server spends is its own work (framing, tokenizing, queueing, decoding,
replying), which is what bench/frontend.py measures. Its answers are random, so it serves no
user: ``--inference_engine_type zero`` is for benchmarks of the front end only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from engines.base import Engine
from engines.model_dir import ModelInfo, load_model_info

ZERO_ENGINE_WARNING = ("THIS SERVER'S ANSWERS ARE NOT MEANINGFUL: --inference_engine_type zero "
                       "runs no model and answers from random logits. It measures the server's "
                       "own work (bench/frontend.py) and serves nobody.")


#: Standard-normal values drawn once; each output is a copy of a window of them. Drawing fresh
#: ones took about 20 us per batch (3 x 384 logits, twice), which the front-end benchmark would
#: count as the server's own work.
POOL_SIZE = 1 << 17


class ZeroEngine(Engine):
    """Returns standard-normal float32 outputs of the batch's shape without running a model
    (embeddings scaled to unit length): copies of windows, at a moving offset, of values drawn
    once.

    Args:
        model_dir: A prepared model folder; only its serving.json is read (no weights load).
        seed: Seed of the random outputs.

    Raises:
        ValueError: An ``embed`` folder without ``embedding_dim``, or a ``classify`` folder
            without ``labels``.
    """

    name = "zero"

    def __init__(self, model_dir: str | Path, *, seed: int = 0) -> None:
        info = load_model_info(model_dir)
        self.input_names = tuple(info.input_names)
        self.output_names = tuple(info.output_names)
        self.task = info.task
        self._width = _output_width(info)
        self._pool = np.random.default_rng(seed).standard_normal(POOL_SIZE, dtype=np.float32)
        self._offset = 0

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch of random outputs; see :meth:`Engine.run`."""
        rows, length = next(iter(feeds.values())).shape
        shape = (rows, self._width or length)
        outputs = {name: self._draw(shape) for name in self.output_names}
        if self.task == "embed":
            for value in outputs.values():
                value /= np.linalg.norm(value, axis=1, keepdims=True)
        return outputs

    def _draw(self, shape: tuple[int, int]) -> np.ndarray:
        """A fresh array of ``shape`` holding the pool's next values (any size: the pool is
        tiled for the rare batch bigger than it)."""
        size = shape[0] * shape[1]
        if size > POOL_SIZE:
            return np.resize(self._pool, size).reshape(shape)
        start = self._offset if self._offset + size <= POOL_SIZE else 0
        self._offset = (start + size) % POOL_SIZE
        return self._pool[start:start + size].reshape(shape).copy()

    def describe(self) -> str:
        """Says plainly that nothing runs."""
        return "zero-cost engine (random logits, no model: front-end benchmarks only)"


def _output_width(info: ModelInfo) -> int | None:
    """The columns of each output row; None: the batch's sequence length."""
    if info.task == "embed":
        if not info.embedding_dim:
            raise ValueError("an embed model's serving.json must give embedding_dim")
        return info.embedding_dim
    if info.task == "classify":
        if not info.labels:
            raise ValueError("a classify model's serving.json must give its labels")
        return len(info.labels)
    return None
