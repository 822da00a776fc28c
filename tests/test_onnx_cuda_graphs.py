"""The ONNX engine's CUDA graphs (engines/onnx_binding.py's GraphRunner), on the CPU: one set of
buffers per captured shape, batches padded into the smallest shape that holds them and their
outputs cut back, the same outputs as plain runs; the engine without CUDA says so and runs as
before. Only onnxruntime's capture itself needs a GPU."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engines import load_engine
from engines.model_dir import load_model_info
from engines.onnx_binding import GraphRunner, graph_options
from engines.shapes import graph_shapes, pick_shape
from tests.text_models import build_tiny_embed_dir

SHAPES = graph_shapes((16, 32), 0, row_counts=(1, 2, 4))


def session_of(model_dir: Path) -> ort.InferenceSession:
    info = load_model_info(model_dir)
    return ort.InferenceSession(str(model_dir / info.onnx_file), providers=["CPUExecutionProvider"])


def batch(rows: int, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 2000, size=(rows, length), dtype=np.int64)
    mask = np.ones((rows, length), dtype=np.int64)
    mask[0, length - 3:] = 0  # a row shorter than the batch, as collate pads one
    types = np.zeros((rows, length), dtype=np.int64)
    types[:, length // 2:] = 1
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}


@pytest.mark.parametrize(("rows", "length", "shape"), [(1, 16, (1, 16)), (3, 10, (4, 16)),
                                                       (2, 17, (2, 32)), (4, 32, (4, 32))])
def test_a_batch_runs_padded_in_its_shape_with_the_plain_runs_outputs(
        tiny_model_dir: Path, rows: int, length: int, shape: tuple[int, int]) -> None:
    session = session_of(tiny_model_dir)
    runner = GraphRunner(session, SHAPES, device="cpu")
    runner.capture()
    feeds = batch(rows, length, seed=rows * 100 + length)
    plain = session.run(list(runner.output_names), feeds, graph_options(-1))
    got = runner.run(feeds)
    assert got is not None and len(got) == len(plain) == 2  # start and end logits
    for ours, theirs in zip(got, plain, strict=True):
        assert ours.shape == theirs.shape == (rows, length)  # cut back to the batch's
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert pick_shape(runner.shapes, rows, length) == shape


def test_outputs_without_a_sequence_are_cut_back_to_the_rows_only(tmp_path: Path) -> None:
    model_dir = build_tiny_embed_dir(tmp_path / "emb")
    session = session_of(model_dir)
    runner = GraphRunner(session, SHAPES, device="cpu")
    runner.capture()
    feeds = batch(3, 12, seed=7)
    [vectors] = runner.run(feeds) or []
    [plain] = session.run(None, feeds)
    assert vectors.shape == plain.shape == (3, plain.shape[1])  # [rows, width], width kept
    np.testing.assert_allclose(vectors, plain, rtol=1e-4, atol=1e-5)


def test_a_batch_no_shape_holds_is_left_to_the_caller(tiny_model_dir: Path) -> None:
    runner = GraphRunner(session_of(tiny_model_dir), SHAPES, device="cpu")
    assert runner.run(batch(5, 8, seed=1)) is None  # more rows than captured
    assert runner.run(batch(1, 33, seed=2)) is None  # longer than captured


def test_the_engine_without_cuda_says_why_in_one_line_and_answers_as_before(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    feeds = batch(2, 16, seed=3)
    plain = load_engine("onnx", tiny_model_dir, device="cpu", threads=1).run(feeds)
    with caplog.at_level(logging.WARNING, logger="engines.onnx_engine"):
        engine = load_engine("onnx", tiny_model_dir, device="cpu", threads=1,
                             onnx_cuda_graphs=True, lengths=(16, 32))
    lines = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert lines == ["ONNX engine runs without CUDA graphs: they need the CUDA provider (the "
                     "engine runs on cpu)"]
    assert engine.graphs is None and "CUDA graphs" not in engine.describe()
    assert engine.device_bound is False
    got = engine.run(feeds)
    for name, value in plain.items():
        np.testing.assert_array_equal(got[name], value)
