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


class ZeroEngine(Engine):
    """Returns standard-normal float32 outputs of the batch's shape without running a model
    (embeddings scaled to unit length).

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
        self._rng = np.random.default_rng(seed)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch of random outputs; see :meth:`Engine.run`."""
        rows, length = next(iter(feeds.values())).shape
        shape = (rows, self._width or length)
        outputs = {name: self._rng.standard_normal(shape, dtype=np.float32)
                   for name in self.output_names}
        if self.task == "embed":
            for value in outputs.values():
                value /= np.linalg.norm(value, axis=1, keepdims=True)
        return outputs

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
