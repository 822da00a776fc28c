"""The sentence-embedding task: texts -> one row each -> one unit vector each.

The model folder's ONNX graph does the pooling itself (engines/task_models.py: mean over the
attention mask, then L2 normalisation) and outputs ``embeddings`` ``[rows, dim]``, so this task
only tokenizes, batches by length and turns the vectors into lists of floats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tasks.base import check_finite
from tasks.text import TEXT_INPUT_NAMES, TextEncoder, TextFeatures, TextRows, rows_of

if TYPE_CHECKING:
    from engines.model_dir import ModelInfo
    from protocol.messages import EmbedRequest
    from settings.server_config import ServerConfig

__all__ = ["EmbedTask"]


class EmbedTask(TextRows):
    """Sentence embeddings (tasks/base.py's ``Task`` for ``embed`` requests).

    A request's texts are its rows: each is cut to ``max_seq_len`` tokens and batched by length
    with other requests' texts.

    Args:
        encoder: The tokenizer settings.
        input_names: The engine inputs ``collate`` produces, in order.
        length_buckets: Lengths batches are padded to (see ``TextRows``).
    """

    name: ClassVar[str] = "embed"
    op: ClassVar[str] = "embed"
    fields: ClassVar[Mapping[str, str]] = {"texts": "array of strings"}
    output_names: tuple[str, ...] = ("embeddings",)

    def __init__(self, encoder: TextEncoder, input_names: Sequence[str] = TEXT_INPUT_NAMES,
                 length_buckets: Sequence[int] = ()) -> None:
        super().__init__(encoder, input_names, length_buckets)

    @classmethod
    def from_model(cls, model_dir: str | Path, info: ModelInfo,
                   config: ServerConfig) -> EmbedTask:
        """The task for a prepared model folder: rows of at most the smaller of the server's
        ``max_seq_len`` and the model's, padded to the server's length buckets."""
        encoder = TextEncoder.from_dir(model_dir, min(config.max_seq_len, info.max_seq_len))
        return cls(encoder, info.input_names, config.bucket_lengths())

    def features(self, request: EmbedRequest) -> TextFeatures:
        """One row per text of an ``embed`` request.

        Raises:
            BadRequest: No texts, or a blank one.
        """
        return self.encoder.encode(request.texts)

    def postprocess(self, features: TextFeatures, embeddings: np.ndarray) -> dict[str, Any]:
        """The request's vectors, as the engine computed them (already unit length).

        Returns:
            ``{"embeddings": [[float, ...], ...], "dim": int, "tokens": int}``, one vector per
            text, in order; ``tokens``: the tokens the model read, special tokens included.

        Raises:
            ValueError: ``embeddings`` does not have one row per text.
            EngineError: a vector holds NaN or an infinity.
        """
        vectors = rows_of(embeddings, features, "embeddings").astype(np.float32, copy=False)
        check_finite(vectors, "embeddings")
        return {"embeddings": vectors.tolist(), "dim": int(vectors.shape[1]),
                "tokens": int(features.lengths.sum())}
