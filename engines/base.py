"""The engine contract: numpy tensors in, numpy tensors out, batch dimension first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

#: Output tensor names every QA engine produces, in this order.
QA_OUTPUT_NAMES: tuple[str, str] = ("start_logits", "end_logits")


class Engine(ABC):
    """A loaded model that runs one batch at a time.

    An engine is owned by one inference-session thread; it need not be thread-safe. Subclasses set
    ``name`` (e.g. ``"onnx"``), ``device`` (e.g. ``"cpu"``, ``"cuda:0"``), ``input_names``, and
    ``precision`` when it runs other than fp32.
    """

    name: str = "engine"
    device: str = "cpu"
    precision: str = "fp32"
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = QA_OUTPUT_NAMES

    @abstractmethod
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch.

        Args:
            feeds: One int64 array of shape ``[rows, seq_len]`` per name in ``input_names``.

        Returns:
            One float32 array of shape ``[rows, seq_len]`` per name in ``output_names``.
        """

    def close(self) -> None:
        """Release the engine's resources; the default does nothing."""

    def describe(self) -> str:
        """One line saying what runs where, for logs."""
        return f"{self.name} on {self.device}"


def check_outputs(feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
    """Raise ``ValueError`` unless every output has exactly one row per input row."""
    rows = next(iter(feeds.values())).shape[0]
    for name, value in outputs.items():
        if value.shape[0] != rows:
            raise ValueError(f"engine output {name!r} has {value.shape[0]} rows for {rows} inputs")
