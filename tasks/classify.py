"""The sequence-classification task: one text -> one row -> its label and every label's
probability (a softmax over the model's logits)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tasks.base import check_finite
from tasks.text import TEXT_INPUT_NAMES, TextEncoder, TextFeatures, TextRows, rows_of

if TYPE_CHECKING:
    from engines.model_dir import ModelInfo
    from protocol.messages import ClassifyRequest
    from settings.server_config import ServerConfig

__all__ = ["ClassifyTask", "softmax"]


class ClassifyTask(TextRows):
    """Sequence classification (tasks/base.py's ``Task`` for ``classify`` requests).

    Args:
        encoder: The tokenizer settings (a text over ``max_seq_len`` tokens is cut).
        labels: The label of each logit, in order; None: ``LABEL_0``, ``LABEL_1``, ... as many
            as the model has logits.
        input_names: The engine inputs ``collate`` produces, in order.
        length_buckets: Lengths batches are padded to (see ``TextRows``).

    Raises:
        ValueError: ``labels`` is empty or names a label twice.
    """

    name: ClassVar[str] = "classify"
    op: ClassVar[str] = "classify"
    fields: ClassVar[Mapping[str, str]] = {"text": "string"}
    output_names: tuple[str, ...] = ("logits",)

    def __init__(self, encoder: TextEncoder, labels: Sequence[str] | None = None,
                 input_names: Sequence[str] = TEXT_INPUT_NAMES,
                 length_buckets: Sequence[int] = ()) -> None:
        super().__init__(encoder, input_names, length_buckets)
        if labels is not None and (not labels or len(set(labels)) != len(labels)):
            raise ValueError(f"labels must be distinct and at least one, got {list(labels)}")
        self.labels: tuple[str, ...] | None = tuple(labels) if labels is not None else None

    @classmethod
    def from_model(cls, model_dir: str | Path, info: ModelInfo,
                   config: ServerConfig) -> ClassifyTask:
        """The task for a prepared model folder: its labels (serving.json), rows of at most the
        smaller of the server's ``max_seq_len`` and the model's, the server's length buckets."""
        encoder = TextEncoder.from_dir(model_dir, min(config.max_seq_len, info.max_seq_len))
        return cls(encoder, info.labels, info.input_names, config.bucket_lengths())

    def features(self, request: ClassifyRequest) -> TextFeatures:
        """One row for the text of a ``classify`` request.

        Raises:
            BadRequest: A blank text.
        """
        return self.encoder.encode([request.text])

    def check_outputs(self, outputs: Mapping[str, np.ndarray], rows: int) -> None:
        """As ``TextRows.check_outputs``, and one logit per label.

        Raises:
            ValueError: Not ``logits`` ``[rows, N]``, or N is not the number of ``labels``.
        """
        super().check_outputs(outputs, rows)
        width = np.asarray(outputs["logits"]).shape[1]
        if self.labels is not None and width != len(self.labels):
            raise ValueError(f"the model gives {width} logits, serving.json names "
                             f"{len(self.labels)} labels")

    def postprocess(self, features: TextFeatures, logits: np.ndarray) -> dict[str, Any]:
        """The most probable label.

        Returns:
            ``{"label": str, "score": float, "scores": {label: probability}}``; the
            probabilities are a softmax over the logits and sum to 1.

        Raises:
            ValueError: ``logits`` is not one row, or does not have one column per label.
            EngineError: a logit is NaN or +infinity, or every one is -infinity (the
                softmax has no answer).
        """
        row = rows_of(logits, features, "logits")[0]
        labels = self.labels or tuple(f"LABEL_{i}" for i in range(row.shape[0]))
        if row.shape[0] != len(labels):
            raise ValueError(f"{row.shape[0]} logits for {len(labels)} labels")
        probabilities = softmax(row)
        check_finite(probabilities, "logits")  # NaN or +inf among the logits spreads to all
        best = int(np.argmax(probabilities))
        return {"label": labels[best], "score": float(probabilities[best]),
                "scores": {label: float(p) for label, p in zip(labels, probabilities,
                                                               strict=True)}}


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities (float64) from one row of logits, computed stably."""
    shifted = np.asarray(logits, dtype=np.float64) - np.max(logits)
    exp = np.exp(shifted)
    return exp / exp.sum()
