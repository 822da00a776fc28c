"""A request as the engine sees it: rows of token ids, and how a batch of them is stacked and
cut apart again. The QA task builds these from its features; a GPU worker behind a broker
(broker/worker.py) receives them ready-made and needs nothing else of the task."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

#: The engine outputs of the QA models, one ``[rows, length]`` array each.
QA_OUTPUTS: tuple[str, ...] = ("start_logits", "end_logits")


class TokenRows(Protocol):
    """What stacking needs of one request: its rows of ids and segment ids, and their lengths."""

    @property
    def input_ids(self) -> np.ndarray: ...

    @property
    def token_type_ids(self) -> np.ndarray: ...

    @property
    def lengths(self) -> np.ndarray: ...


class RowShape:
    """``rows`` and ``max_len`` of a request held as ``[rows, max_len]`` arrays."""

    __slots__ = ()
    input_ids: np.ndarray

    @property
    def rows(self) -> int:
        """Rows (windows) this request takes in a batch."""
        return int(self.input_ids.shape[0])

    @property
    def max_len(self) -> int:
        """Tokens in its longest row."""
        return int(self.input_ids.shape[1])


@dataclass(frozen=True, slots=True, eq=False)
class EngineRows(RowShape):
    """One request's rows, as they travel to a worker that only runs the engine.

    Attributes:
        input_ids: ``[rows, max_len]`` token ids, padded with ``pad_id``.
        token_type_ids: ``[rows, max_len]`` segment ids, padded with 0.
        lengths: ``[rows]`` real tokens in each row.
        pad_id: The tokenizer's padding id.
        padded_length: The length a batch holding this request is padded to at least (the
            front end's length bucket, or ``max_len``).
    """

    input_ids: np.ndarray
    token_type_ids: np.ndarray
    lengths: np.ndarray
    pad_id: int
    padded_length: int


def stack_rows(batch: Sequence[TokenRows], input_names: Sequence[str], pad_id: int,
               length: int) -> dict[str, np.ndarray]:
    """Every row of every request, right-padded to ``length``, as int64 engine inputs.

    Returns:
        One ``[sum of rows, length]`` array per name in ``input_names`` (of ``input_ids``,
        ``attention_mask``, ``token_type_ids``); requests' rows follow the batch order.
    """
    if not batch:
        raise ValueError("cannot stack an empty batch")
    shape = (sum(int(r.input_ids.shape[0]) for r in batch), length)
    ids = np.full(shape, pad_id, dtype=np.int64)
    mask, types = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    row = 0
    for request in batch:
        rows, n = request.input_ids.shape
        ids[row:row + rows, :n] = request.input_ids
        types[row:row + rows, :n] = request.token_type_ids
        mask[row:row + rows, :n] = np.arange(n) < request.lengths[:, None]
        row += rows
    arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    return {name: arrays[name] for name in input_names}


def split_rows(row_counts: Sequence[int], outputs: Mapping[str, np.ndarray],
               names: Sequence[str] = QA_OUTPUTS) -> list[tuple[np.ndarray, ...]]:
    """Cut a batch's outputs back into one tuple (one array per name) per request.

    Raises:
        ValueError: An output is missing or does not have one row per batch row.
    """
    total = sum(row_counts)
    arrays = [np.asarray(outputs.get(name)) for name in names]
    for name, value in zip(names, arrays):
        if value.ndim != 2 or value.shape[0] != total:
            raise ValueError(f"{name} must have shape [{total}, L], got {value.shape}")
    bounds = np.cumsum([0, *row_counts]).tolist()
    return [tuple(value[a:b] for value in arrays) for a, b in zip(bounds[:-1], bounds[1:])]
