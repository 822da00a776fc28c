"""The PyTorch engine's CUDA graphs, on the CPU: the shapes captured, the shape each batch runs
on, the padding (rows up to the next captured count, lengths to the next captured length, the
outputs cut back), and the fallback to the traced graph with its one line. Everything but
``torch.cuda.CUDAGraph`` runs here: ``TracedReplay`` replays the traced graph into the same
static buffers a CUDA graph would use."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from client import Client
from engines import SETTING_CHOICES, TORCH_GRAPHS, load_engine
from engines.shapes import capture_lengths, graph_shapes, pick_shape
from engines.sim_host import PARTS
from engines.torch_cuda_graphs import CudaGraphCapture, ShapeGraphs, TracedReplay
from engines.torch_engine import TorchEngine
from engines.torch_graph import Forward, Stacked
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS
from tests.text_models import build_tiny_embed_dir


def _feeds(rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch as a task collates it: real ids, row r padded (mask 0) after a share of the
    length that differs per row, two segments."""
    generator = np.random.default_rng(seed)
    ids = generator.integers(1, 1000, size=(rows, length), dtype=np.int64)
    mask = np.zeros((rows, length), dtype=np.int64)
    for row in range(rows):
        mask[row, :max(1, (row + 1) * length // rows)] = 1
    ids[mask == 0] = 0
    types = np.zeros((rows, length), dtype=np.int64)
    types[:, length // 3:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types * mask}


def _graphs(model_dir: Path, **options: Any) -> TorchEngine:
    """A CPU engine with the CPU stand-in for CUDA graphs."""
    return TorchEngine(model_dir, device="cpu", threads=1, graph="cudagraphs",
                       capture=TracedReplay, **options)


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path) -> TorchEngine:
    return TorchEngine(tiny_model_dir, device="cpu", threads=1, graph="traced")


@pytest.fixture(scope="module")
def graphed(tiny_model_dir: Path) -> TorchEngine:
    return _graphs(tiny_model_dir, lengths=(64,), max_seq_len=128, max_tokens=2048)


def test_the_shapes_captured_are_seven_row_counts_by_the_lengths_within_the_budget() -> None:
    assert capture_lengths((), 384) == (64, 128, 256, 384)  # the default lengths
    assert capture_lengths((), 200) == (64, 128, 200)  # capped at the longest served
    assert capture_lengths((32, 100, 512), 384) == (32, 100, 384)  # buckets; longest closes
    shapes = graph_shapes((64, 128, 256, 384), 16384)
    assert len(shapes) == 27 and (64, 384) not in shapes and (32, 384) in shapes
    assert shapes[0] == (64, 256)  # largest first: later captures reuse its pool
    assert len(graph_shapes((64, 128, 256, 384), 0)) == 28  # no budget


def test_a_batch_runs_on_the_smallest_captured_shape_that_holds_it() -> None:
    shapes = graph_shapes((64, 128, 384), 2048)
    assert pick_shape(shapes, 1, 64) == (1, 64)
    assert pick_shape(shapes, 3, 40) == (4, 64)
    assert pick_shape(shapes, 9, 65) == (16, 128)
    assert pick_shape(shapes, 5, 200) is None  # 8 x 384 is over the budget: not captured
    assert pick_shape(shapes, 17, 128) is None and pick_shape(shapes, 1, 385) is None


class _Masked(torch.nn.Module):
    """Per-token outputs that show what each position was fed: ids under the mask, and types."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor,
                types: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ids * mask, types


def test_a_batch_is_padded_with_its_last_row_and_masked_tokens_and_cut_back() -> None:
    forward = torch.jit.trace(Stacked(_Masked()), torch.ones((3, 2, 8), dtype=torch.int64))
    names = ("input_ids", "attention_mask", "token_type_ids")
    graphs = ShapeGraphs.capture(forward, TracedReplay, [(4, 8)], names,
                                 SimpleNamespace(vocab_size=1000, type_vocab_size=2),
                                 torch.device("cpu"), torch.float32, per_token=True)
    stacked = np.stack([_feeds(3, 5, seed=n)[name] for n, name in enumerate(names)])
    ran = graphs.run(stacked)
    assert ran is not None
    outputs, shape = ran
    assert shape == (4, 8) and outputs.shape == (2, 3, 5)
    np.testing.assert_array_equal(outputs[0], stacked[0] * stacked[1])
    np.testing.assert_array_equal(outputs[1], stacked[2])
    fed = graphs.replays[(4, 8)].static_input.numpy()
    np.testing.assert_array_equal(fed[:, :3, :5], stacked)
    assert not fed[:, :3, 5:].any()  # padded tokens: ids, mask and types 0
    np.testing.assert_array_equal(fed[:, 3], fed[:, 2])  # the padded row: the last real one


@pytest.mark.parametrize("shape, captured", [((4, 64), (4, 64)), ((3, 40), (4, 64)),
                                             ((1, 7), (1, 64)), ((5, 100), (8, 128)),
                                             ((16, 128), (16, 128)), ((3, 64), (4, 64))])
def test_padded_rows_and_tokens_leave_the_outputs_of_the_traced_graph(
        graphed: TorchEngine, traced: TorchEngine, shape: tuple[int, int],
        captured: tuple[int, int]) -> None:
    feeds = _feeds(*shape, seed=shape[0] * shape[1])
    ours, theirs = graphed.run(feeds), traced.run(feeds)
    assert graphed.last_shape == captured and traced.last_shape is None
    for name in ("start_logits", "end_logits"):
        assert ours[name].shape == shape and ours[name].dtype == np.float32
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
        real = feeds["attention_mask"] == 1
        assert (ours[name].argmax(axis=1) == theirs[name].argmax(axis=1)).all()
        assert np.isfinite(ours[name][real]).all()


def test_a_batch_larger_than_every_captured_shape_runs_the_traced_graph(
        graphed: TorchEngine, traced: TorchEngine) -> None:
    assert graphed.describe().count("lengths 64,128)") == 1
    for shape in [(33, 64), (17, 128), (2, 300)]:  # more rows than 2048 tokens allow; longer
        feeds = _feeds(*shape)
        ours = graphed.run(feeds)
        assert graphed.last_shape is None
        np.testing.assert_allclose(ours["start_logits"], traced.run(feeds)["start_logits"],
                                   rtol=1e-5, atol=1e-6)
    graphed.run(_feeds(2, 64))
    assert graphed.last_shape == (2, 64)


def test_launched_batches_in_flight_together_give_what_each_run_gives(
        graphed: TorchEngine) -> None:
    assert graphed.overlaps  # an executor may copy the next batch in while one runs
    shapes = [(3, 40), (16, 128), (1, 7), (3, 40), (33, 64)]  # the last: no captured shape
    batches = [_feeds(*shape, seed=n) for n, shape in enumerate(shapes)]
    launched = [graphed.launch(batches[0])]
    answers = []
    for feeds in batches[1:]:  # two in flight: each launched before the last one is taken
        launched.append(graphed.launch(feeds))
        answers.append(launched.pop(0).result())
    answers.append(launched.pop(0).result())
    for feeds, answer in zip(batches, answers, strict=True):
        want = graphed.run(feeds)
        for name, value in want.items():
            assert answer[name].shape == value.shape and answer[name].dtype == np.float32
            np.testing.assert_allclose(answer[name], value, rtol=1e-6, atol=1e-7)


def test_the_gpu_check_times_each_host_part_of_a_graph_s_run(
        graphed: TorchEngine, traced: TorchEngine) -> None:
    from bench.host_parts import host_parts_ms

    parts = host_parts_ms(graphed, _feeds(3, 40), runs=3)
    assert set(parts) == {part.name for part in PARTS}  # what a simulated device spends
    assert all(ms >= 0 for ms in parts.values()) and parts["pad"] > 0
    assert host_parts_ms(graphed, _feeds(33, 64), runs=1) == {}  # no captured shape holds it
    assert host_parts_ms(traced, _feeds(3, 40), runs=1) == {}  # no graphs


def test_embeddings_are_cut_back_to_the_batchs_rows_only(tmp_path: Path) -> None:
    folder = build_tiny_embed_dir(tmp_path / "embed", max_seq_len=128)
    graphed = _graphs(folder, max_tokens=1024)
    plain = TorchEngine(folder, device="cpu", threads=1, graph="traced")
    assert graphed.graph == "cudagraphs"
    feeds = _feeds(3, 50)
    ours, theirs = graphed.run(feeds), plain.run(feeds)
    assert graphed.last_shape == (4, 64) and ours["embeddings"].shape == (3, 32)
    np.testing.assert_allclose(ours["embeddings"], theirs["embeddings"], rtol=1e-5, atol=1e-6)


def test_bf16_graphs_give_the_bf16_traced_graphs_outputs(tiny_model_dir: Path) -> None:
    graphed = _graphs(tiny_model_dir, precision="bf16", lengths=(64,), max_tokens=512)
    plain = TorchEngine(tiny_model_dir, device="cpu", threads=1, precision="bf16",
                        graph="traced")
    assert (graphed.precision, graphed.graph) == ("bf16", "cudagraphs")
    feeds = _feeds(3, 30)
    ours, theirs = graphed.run(feeds), plain.run(feeds)
    assert graphed.last_shape == (4, 64)
    np.testing.assert_allclose(ours["start_logits"], theirs["start_logits"], atol=2e-2)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "engines.torch_engine" and r.levelno >= logging.WARNING]


def test_without_cuda_the_engine_runs_the_traced_graph_and_says_why_in_one_line(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engines.torch_engine"):
        asked = load_engine("pytorch", tiny_model_dir, device="cpu", threads=1,
                            graph="cudagraphs")
    assert asked.graph == "traced" and "traced graph" in asked.describe()
    assert _warnings(caplog) == ["PyTorch engine runs the traced graph, not CUDA graphs: torch "
                                 "sees no CUDA device (the engine runs on cpu)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engines.torch_engine"):
        default = load_engine("pytorch", tiny_model_dir, device="cpu", threads=1)
    assert default.graph == "traced" and _warnings(caplog) == []  # auto: traced off CUDA
    assert not default.device_bound and default.device_s is None


def test_a_failed_capture_leaves_the_traced_graph_with_one_line(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    def cuda_capture(forward: Forward, static_input: torch.Tensor) -> Any:
        return CudaGraphCapture(static_input.device)(forward, static_input)  # no CUDA here

    with caplog.at_level(logging.INFO, logger="engines.torch_engine"):
        engine = TorchEngine(tiny_model_dir, device="cpu", threads=1, graph="cudagraphs",
                             capture=cuda_capture)
    assert engine.graph == "traced"
    [line] = _warnings(caplog)
    assert line.startswith("PyTorch engine runs the traced graph, not CUDA graphs: capture "
                           "failed: RuntimeError: ") and "\n" not in line
    engine.run(_feeds(2, 64))
    assert engine.last_shape is None


class _Frozen:
    """A capture whose replay does not read its input: what it ran at capture is what it gives
    back ever after (a graph that recorded a copy of its input instead of reading the buffer)."""

    def __init__(self, forward: Forward, static_input: torch.Tensor) -> None:
        self.static_input = static_input
        self.static_output = TracedReplay(forward, static_input.clone()).static_output

    def replay(self) -> None:
        pass


def test_a_replay_that_ignores_its_input_is_caught_at_capture(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engines.torch_engine"):
        engine = TorchEngine(tiny_model_dir, device="cpu", threads=1, graph="cudagraphs",
                             capture=_Frozen, lengths=(64,), max_tokens=256)
    assert engine.graph == "traced"
    [line] = _warnings(caplog)
    assert "replay differs from the traced graph" in line


def test_the_setting_offers_auto_and_every_graph() -> None:
    assert TORCH_GRAPHS == ("cudagraphs", "traced", "eager")
    assert SETTING_CHOICES["pytorch_graph"] == ("auto", *TORCH_GRAPHS)
    assert ServerConfig().pytorch_graph == "auto"


def _answers(model_dir: Path, graph: str) -> tuple[list[dict[str, Any]], str]:
    """Long contexts (several windows each) and short ones, all at once, through a server whose
    engine runs ``graph`` (cudagraphs: the CPU stand-in); the answers, and the engine's words."""
    def factory() -> TorchEngine:
        if graph == "cudagraphs":
            return _graphs(model_dir, max_seq_len=128, max_tokens=4096)
        return TorchEngine(model_dir, device="cpu", threads=1, graph=graph)

    config = ServerConfig(port=0, model_dir=str(model_dir), inference_engine_type="pytorch",
                          num_inference_sessions=1, batching="fixed", max_batch_size=8,
                          max_seq_len=128, doc_stride=32)
    contexts = [*CONTEXTS, " ".join(CONTEXTS * 2), " ".join(CONTEXTS[::-1] * 3)]
    with InferenceServer(config, engine_factory=factory) as server, \
            Client(*server.address) as client:
        futures = [client.submit(q, c) for q in QUESTIONS for c in contexts]
        replies = [future.result(timeout=120) for future in futures]
        return replies, client.stats(timeout=30)["engine"]["description"]


def test_the_server_answers_with_graphs_what_it_answers_with_the_traced_graph(
        tiny_model_dir: Path) -> None:
    (graphed, words), (plain, _) = (_answers(tiny_model_dir, "cudagraphs"),
                                    _answers(tiny_model_dir, "traced"))
    # 7 row counts at 64 tokens, 6 at 128 (64 x 128 is over the 4096-token budget)
    assert "CUDA graphs of the traced graph for 13 shapes" in words
    assert len(graphed) == len(plain) == 48
    for got, expected in zip(graphed, plain, strict=True):
        assert (got["answer"], got["start"], got["end"]) == \
            (expected["answer"], expected["start"], expected["end"])
        assert got["score"] == pytest.approx(expected["score"], rel=1e-4, abs=1e-6)
