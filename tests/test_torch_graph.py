"""The PyTorch engine's traced graph: the eager model's outputs, and eager where tracing cannot
be trusted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engines import load_engine
from engines.torch_graph import CHECK_SHAPES, TRACE_SHAPE, sample_inputs, trace_checked

CPU = torch.device("cpu")


def _feeds(rows: int, length: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Feeds of a batch whose rows are padded to different lengths, as a task collates them."""
    tensors = sample_inputs(names, rows, length, 1000, CPU)
    feeds = {name: tensor.numpy().copy() for name, tensor in zip(names, tensors, strict=True)}
    for row in range(rows):  # row r has (r + 1) / rows of the length
        feeds["attention_mask"][row, (row + 1) * length // rows:] = 0
    return feeds


@pytest.mark.parametrize("shape", [(1, 5), (2, 16), (4, 64), (3, 384)])
def test_the_traced_engine_returns_the_eager_engines_outputs(tiny_model_dir: Path,
                                                             shape: tuple[int, int]) -> None:
    traced = load_engine("pytorch", tiny_model_dir, device="cpu", threads=1)
    eager = load_engine("pytorch", tiny_model_dir, device="cpu", threads=1, graph="eager")
    assert (traced.graph, eager.graph) == ("traced", "eager")
    assert "traced graph" in traced.describe() and "eager graph" in eager.describe()
    feeds = _feeds(*shape, traced.input_names)
    ours, theirs = traced.run(feeds), eager.run(feeds)
    assert set(ours) == set(theirs) == {"start_logits", "end_logits"}
    for name in ours:
        assert ours[name].shape == shape and ours[name].dtype == np.float32
        np.testing.assert_allclose(ours[name], theirs[name], atol=1e-5)


class _BranchesOnLength(torch.nn.Module):
    """Python that branches on its input's length: a trace records one branch only."""

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        if input_ids.shape[1] > 10:
            return (input_ids.float() * 2,)
        return (input_ids.float() * 3,)


class _ReturnsAString(torch.nn.Module):
    """Outputs a trace cannot record."""

    def forward(self, input_ids: torch.Tensor) -> tuple[str]:
        return (f"{input_ids.shape}",)


def test_a_graph_that_disagrees_with_the_model_on_other_shapes_is_not_used() -> None:
    lengths = [length for _, length in [TRACE_SHAPE, *CHECK_SHAPES]]
    assert lengths[0] > 10 and min(lengths) <= 10  # the check runs the branch not traced
    graph, why = trace_checked(_BranchesOnLength(), ["input_ids"], 1000, CPU, torch.float32)
    assert graph is None and "differs from the eager model" in why


def test_a_model_that_cannot_be_traced_is_not_used_and_the_reason_is_given() -> None:
    graph, why = trace_checked(_ReturnsAString(), ["input_ids"], 1000, CPU, torch.float32)
    assert graph is None and why.startswith("tracing failed: ")


def test_an_unknown_graph_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown PyTorch graph"):
        load_engine("pytorch", tiny_model_dir, device="cpu", graph="compiled")
