"""The PyTorch engine's traced graph: the eager model's outputs, and eager where tracing cannot
be trusted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from client import Client
from engines import TORCH_GRAPHS, load_engine
from engines.torch_graph import CHECK_SHAPES, TRACE_SHAPE, sample_inputs, trace_checked
from server import InferenceServer, ServerConfig

CPU = torch.device("cpu")
CONFIG = SimpleNamespace(vocab_size=1000, type_vocab_size=2)
ROOT = Path(__file__).resolve().parent.parent


def _feeds(rows: int, length: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Feeds of a batch whose rows are padded to different lengths, as a task collates them."""
    tensors = sample_inputs(names, rows, length, CONFIG, CPU)
    feeds = {name: tensor.numpy().copy() for name, tensor in zip(names, tensors, strict=True)}
    feeds["attention_mask"][:] = 1
    for row in range(rows):  # row r keeps the first (r + 1) / rows of the length
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
    """Python that branches on its input's length (a trace records one branch only): beyond
    ``over`` tokens its outputs are ``factor`` times larger."""

    def __init__(self, over: int, factor: float) -> None:
        super().__init__()
        self.over, self.factor = over, factor

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        scale = self.factor if input_ids.shape[1] > self.over else 1.0
        return (input_ids.float() * scale / 1000,)


class _ReturnsAString(torch.nn.Module):
    """Outputs a trace cannot record."""

    def forward(self, input_ids: torch.Tensor) -> tuple[str]:
        return (f"{input_ids.shape}",)


def test_a_graph_that_disagrees_with_the_model_on_other_shapes_is_not_used() -> None:
    lengths = [length for _, length in [TRACE_SHAPE, *CHECK_SHAPES]]
    assert lengths[0] > 10 and min(lengths) <= 10  # the check runs the branch not traced
    graph, why = trace_checked(_BranchesOnLength(10, 2.0), ["input_ids"], CONFIG, 384, CPU,
                               torch.float32)
    assert graph is None and "differs from the eager model" in why


def test_the_check_reaches_the_longest_length_served_and_small_relative_differences() -> None:
    longest = 384
    assert max(length for _, length in [TRACE_SHAPE, *CHECK_SHAPES]) < 100 < longest
    # outputs of at most 1 that differ by 0.1% beyond 100 tokens: only the longest shape shows
    graph, why = trace_checked(_BranchesOnLength(100, 1.001), ["input_ids"], CONFIG, longest,
                               CPU, torch.float32)
    assert graph is None and f"on 2 x {longest} tokens" in why
    kept, why = trace_checked(_BranchesOnLength(100, 1.001), ["input_ids"], CONFIG, 64, CPU,
                              torch.float32)
    assert kept is not None and why == ""


def test_a_model_that_cannot_be_traced_is_not_used_and_the_reason_is_given() -> None:
    graph, why = trace_checked(_ReturnsAString(), ["input_ids"], CONFIG, 64, CPU,
                               torch.float32)
    assert graph is None and why.startswith("tracing failed: ")


def test_samples_stay_inside_the_models_token_types() -> None:
    """An out-of-range embedding index on CUDA is a device-side assert, fatal to the process."""
    names = ("input_ids", "attention_mask", "token_type_ids")
    one_type = sample_inputs(names, 2, 16, SimpleNamespace(vocab_size=30, type_vocab_size=1),
                             CPU)
    assert int(one_type[2].max()) == 0 and int(one_type[0].max()) < 30
    two_types = sample_inputs(names, 2, 16, CONFIG, CPU)
    assert int(two_types[2].max()) == 1 and int(two_types[1][-1].min()) == 0  # a padded row


def test_an_unknown_graph_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown PyTorch graph"):
        load_engine("pytorch", tiny_model_dir, device="cpu", graph="compiled")


def test_the_server_runs_the_graph_it_is_told_to(tiny_model_dir: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), inference_engine_type="pytorch",
                          pytorch_graph="eager", device="cpu", num_inference_sessions=1,
                          threads_per_session=1)
    with InferenceServer(config) as server, Client(*server.address) as client:
        client.answer("Who?", "Ada wrote it.", timeout=60)
        description = client.stats(timeout=30)["engine"]["description"]
    assert "eager graph" in description


def test_the_convoy_benchmark_measures_every_graph(tiny_model_dir: Path) -> None:
    out = subprocess.run([sys.executable, "bench/gil_convoy.py", "--model_dir",
                          str(tiny_model_dir), "--runs", "2", "--length", "8"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith(("traced ", "eager "))]
    # each of TORCH_GRAPHS in turn, named by the graph that runs: on the CPU, cudagraphs runs
    # the traced graph
    assert TORCH_GRAPHS == ("cudagraphs", "traced", "eager")
    assert [row[0] for row in rows] == ["traced"] * 6 + ["eager"] * 3
    assert all(float(row[-2]) > 0 and float(row[-1]) > 0 for row in rows)
    assert "rows 1, length 8, runs 2" in out
