"""What a broker worker's sessions run: front ends' engine inputs in, engine outputs out, for a
model of any task.

The front end collates each request alone (its task's ``collate``) and, once the outputs come
back, chooses the answer; a worker only stacks requests' rows into batches and cuts the
engine's outputs back per request, as an executor does (workers/executor_wire.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from broker.wire import Feeds
from engines.model_dir import ModelInfo
from workers.executor_wire import pad_columns

#: Tasks whose every output is one value per token (``[rows, length]``).
PER_TOKEN_TASKS = frozenset({"qa"})


class FeedsTask:
    """The part of a task a worker needs: stack inputs, cut outputs, return them.

    Args:
        input_names: The engine's inputs, in its order.
        output_names: The outputs its task reads (serving.json's): only those go back.
        task: The model's task name: a qa model's outputs are per token, and go back cut to
            each request's own width. Others go back whole: a task reads outputs as wide as
            its batch's longest request in one process too, and a plug-in's outputs may be of
            any width.
        on_batch: Called as each batch leaves the queue.
    """

    def __init__(self, input_names: Sequence[str], output_names: Sequence[str], task: str,
                 on_batch: Callable[[], None] = lambda: None) -> None:
        self.input_names, self.output_names = tuple(input_names), frozenset(output_names)
        self.per_token = task in PER_TOKEN_TASKS
        self.on_batch = on_batch

    def collate(self, batch: Sequence[Feeds]) -> dict[str, np.ndarray]:
        """Every request's rows, padded with zeros to the batch's widest (pad ids that no
        attention sees), and a word to ``on_batch``: the batch left the queue.

        Raises:
            KeyError: a request lacks one of the engine's inputs.
        """
        self.on_batch()
        width = max(feeds.max_len for feeds in batch)
        return {name: np.concatenate([pad_columns(feeds.arrays[name], width)
                                      for feeds in batch]) for name in self.input_names}

    def split_outputs(self, batch: Sequence[Feeds],
                      outputs: Mapping[str, np.ndarray]) -> list[tuple[dict[str, np.ndarray]]]:
        """Each request's rows of every output (per-token ones cut to its width).

        Raises:
            ValueError: an output does not have one row per batch row.
        """
        total = sum(feeds.rows for feeds in batch)
        arrays = {name: np.asarray(value) for name, value in outputs.items()
                  if name in self.output_names}
        for name, value in arrays.items():
            if value.ndim == 0 or value.shape[0] != total:
                raise ValueError(f"output {name} must have {total} rows, got {value.shape}")
        out, first = [], 0
        for feeds in batch:
            last = first + feeds.rows
            out.append(({name: self._cut(value[first:last], feeds.max_len)
                         for name, value in arrays.items()},))
            first = last
        return out

    def _cut(self, value: np.ndarray, width: int) -> np.ndarray:
        return value[:, :width] if self.per_token and value.ndim > 1 else value

    def postprocess(self, feeds: Feeds, outputs: dict[str, np.ndarray]) -> dict[str, Any]:
        """The request's outputs, for the reply entry (the front end chooses the answer)."""
        return {"outputs": outputs}


def cannot_run(info: ModelInfo, feeds: Feeds) -> str | None:
    """Why the model's engine cannot take ``feeds`` (an input it lacks, rows longer than it
    takes), or None."""
    missing = set(info.input_names) - set(feeds.arrays)
    if missing:
        return f"the inputs lack {sorted(missing)}"
    if feeds.max_len > info.max_seq_len:
        return f"rows of {feeds.max_len} tokens; the model takes {info.max_seq_len}"
    return None
