"""An engine that costs nothing: random logits of the right shape, at once.

With it, everything the server spends is its own work (framing, tokenizing, queueing, decoding,
replying), which is what bench/frontend.py measures. Its answers are random, so it serves no
user: ``--inference_engine_type zero`` is for benchmarks of the front end only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from engines.base import Engine
from engines.model_dir import load_model_info

ZERO_ENGINE_WARNING = ("THIS SERVER'S ANSWERS ARE NOT MEANINGFUL: --inference_engine_type zero runs "
                       "no model and answers from random logits. It measures the server's own "
                       "work (bench/frontend.py) and serves nobody.")


class ZeroEngine(Engine):
    """Returns standard-normal float32 logits of the batch's shape without running a model.

    Args:
        model_dir: A prepared model folder; only its input names are read (no weights load).
        seed: Seed of the random logits.
    """

    name = "zero"

    def __init__(self, model_dir: str | Path, *, seed: int = 0) -> None:
        self.input_names = tuple(load_model_info(model_dir).input_names)
        self._rng = np.random.default_rng(seed)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch of random logits; see :meth:`Engine.run`."""
        shape = next(iter(feeds.values())).shape
        return {name: self._rng.standard_normal(shape, dtype=np.float32)
                for name in self.output_names}

    def describe(self) -> str:
        """Says plainly that nothing runs."""
        return "zero-cost engine (random logits, no model: front-end benchmarks only)"
