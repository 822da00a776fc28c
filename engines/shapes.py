"""The batch shapes an engine captures as CUDA graphs, which one a batch runs on, and the padding
that takes it there: torch-free, for the PyTorch engine (engines/torch_cuda_graphs.py) and the
ONNX one (engines/onnx_binding.py's ``GraphRunner``) alike.

A graph records one shape, so an engine captures one per (rows, length) of ``ROW_COUNTS`` x its
lengths (the server's ``--length_buckets``, or ``DEFAULT_LENGTHS``), within the token budget. A
batch runs on the smallest captured shape that holds it:

- **lengths** padded with masked tokens (ids, mask and types 0): attention gives them no weight,
  so the real tokens' outputs do not change; per-token outputs are cut back to the batch's;
- **rows** padded with copies of the batch's last row: real inputs, so no row is all padding
  (a fully masked row can give NaN in some attention kernels); their outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Row counts captured; a batch's rows are padded up to the next of them.
ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)
#: Lengths captured without ``--length_buckets`` (those under the longest served, then it).
DEFAULT_LENGTHS = (64, 128, 256, 384)
def capture_lengths(buckets: Sequence[int], longest: int) -> tuple[int, ...]:
    """The lengths to capture: ``buckets`` (else ``DEFAULT_LENGTHS``) under ``longest``, then
    ``longest`` itself (the longest length served), ascending."""
    return tuple(sorted({*(n for n in (buckets or DEFAULT_LENGTHS) if 0 < n < longest),
                         longest}))


def graph_shapes(lengths: Sequence[int], max_tokens: int,
                 row_counts: Sequence[int] = ROW_COUNTS) -> list[tuple[int, int]]:
    """Every (rows, length) to capture: each row count at each length, within ``max_tokens``
    rows x length (0: no budget; one row always), largest first (see the module docstring)."""
    shapes = [(rows, length) for length in lengths for rows in row_counts
              if rows == 1 or not max_tokens or rows * length <= max_tokens]
    return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape), reverse=True)


def row_steps(shapes: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The row counts of ``shapes``, ascending: what an engine that runs them pads rows up to
    (``Engine.row_steps``)."""
    return tuple(sorted({rows for rows, _ in shapes}))


def length_steps(shapes: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The lengths of ``shapes``, ascending: what an engine that runs them pads lengths up to
    (``Engine.length_steps``)."""
    return tuple(sorted({length for _, length in shapes}))


def pick_shape(shapes: Sequence[tuple[int, int]], rows: int,
               length: int) -> tuple[int, int] | None:
    """The captured shape a batch of ``rows`` x ``length`` runs on: the shortest captured length
    that holds it, with the fewest captured rows that hold it there; None when none does."""
    fitting = [shape for shape in shapes if shape[0] >= rows and shape[1] >= length]
    if not fitting:
        return None
    shortest = min(n for _, n in fitting)
    return min((shape for shape in fitting if shape[1] == shortest), key=lambda s: s[0])


def pad_into(host: np.ndarray, stacked: np.ndarray) -> None:
    """Write a batch (``[inputs, rows, length]``) into a captured shape's host buffer
    (``[inputs, shape rows, shape length]``, at least as large), padded as the module says."""
    _, rows, length = stacked.shape
    host[:, :rows, :length] = stacked
    host[:, :rows, length:] = 0  # masked tokens
    host[:, rows:, :] = host[:, rows - 1:rows, :]  # padded rows: the last real row
