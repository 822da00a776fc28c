"""What a broker worker's sessions run: the front end's token rows in, the logits out.

The front end tokenizes and, once the logits come back, chooses the answer; a worker only
stacks rows into batches and cuts the engine's outputs back per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tasks.rows import EngineRows, split_rows, stack_rows


class RowsTask:
    """The part of the QA task a worker needs: stack rows, cut outputs, return logits."""

    def __init__(self, input_names: Sequence[str],
                 on_batch: Callable[[], None] = lambda: None) -> None:
        self.input_names = tuple(input_names)
        self.on_batch = on_batch

    def collate(self, batch: Sequence[EngineRows]) -> dict[str, np.ndarray]:
        """Every request's rows, padded to the batch's longest padded length (and a word to
        ``on_batch``: the batch left the queue)."""
        self.on_batch()
        return stack_rows(batch, self.input_names, batch[0].pad_id,
                          max(rows.padded_length for rows in batch))

    def split_outputs(self, batch: Sequence[EngineRows],
                      outputs: Any) -> list[tuple[np.ndarray, ...]]:
        """One (start, end) logits pair per request."""
        return split_rows([rows.rows for rows in batch], outputs)

    def postprocess(self, rows: EngineRows, start: np.ndarray, end: np.ndarray) -> dict[str, Any]:
        """The logits of the request's own tokens (the front end chooses the answer)."""
        return {"start": start[:, :rows.max_len], "end": end[:, :rows.max_len]}
