"""Both engines load what export_model_dir saved and agree with each other."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engines import load_engine
from engines.base import check_outputs
from engines.model_dir import METADATA_FILE, ModelDirError, load_model_info
from scheduling.session import dummy_feeds
from preparation.export import sample_feeds


def _feeds(model_dir: Path) -> dict[str, np.ndarray]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sample_feeds(tokenizer, load_model_info(model_dir).input_names)


def test_model_dir_holds_weights_tokenizer_onnx_and_metadata(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"model.onnx", "model.safetensors", "config.json", "tokenizer.json", METADATA_FILE} <= names
    info = load_model_info(tiny_model_dir)
    assert info.input_names == ["input_ids", "attention_mask", "token_type_ids"]
    assert info.meaningful is False and "NOT MEANINGFUL" in (info.warning or "")
    assert info.onnx_max_abs_diff is not None and info.onnx_max_abs_diff < 1e-3


@pytest.mark.parametrize("kind", ["onnx", "pytorch", "zero"])
def test_engine_returns_one_row_of_logits_per_input_row(tiny_model_dir: Path, kind: str) -> None:
    engine = load_engine(kind, tiny_model_dir, device="auto", threads=1)
    feeds = _feeds(tiny_model_dir)
    out = engine.run(feeds)
    rows, length = feeds["input_ids"].shape
    assert set(out) == {"start_logits", "end_logits"}
    for value in out.values():
        assert value.shape == (rows, length) and value.dtype == np.float32
    assert engine.device == "cpu"  # no GPU on CI: "auto" must fall back cleanly


def test_the_zero_engine_draws_fresh_writable_outputs_of_any_size(tiny_model_dir: Path) -> None:
    from engines.zero_engine import POOL_SIZE

    engine = load_engine("zero", tiny_model_dir)
    feeds = _feeds(tiny_model_dir)
    first, second = engine.run(feeds), engine.run(feeds)
    assert not np.array_equal(first["start_logits"], second["start_logits"])
    assert not np.array_equal(first["start_logits"], first["end_logits"])
    kept = second["start_logits"].copy()
    first["start_logits"][:] = 0.0  # outputs are the caller's: writing one changes no other
    np.testing.assert_array_equal(second["start_logits"], kept)
    length = POOL_SIZE // 3 + 1  # three rows of it are more than the pool holds
    big = engine.run({name: np.ones((3, length), dtype=np.int64) for name in feeds})
    assert big["start_logits"].shape == (3, length) and np.isfinite(big["start_logits"]).all()


def test_onnx_and_pytorch_logits_agree(tiny_model_dir: Path) -> None:
    feeds = _feeds(tiny_model_dir)
    onnx_out = load_engine("onnx", tiny_model_dir, threads=1).run(feeds)
    torch_out = load_engine("pytorch", tiny_model_dir, threads=1).run(feeds)
    mask = feeds["attention_mask"].astype(bool)
    for name in ("start_logits", "end_logits"):
        np.testing.assert_allclose(onnx_out[name][mask], torch_out[name][mask], atol=1e-4)


def test_engines_name_outputs_by_the_model_whatever_order_serving_json_lists_them(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """PyTorch named its outputs in serving.json's order: listed the other way round, start
    and end swapped and the answers changed silently."""
    import shutil

    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    meta = json.loads((folder / METADATA_FILE).read_text())
    (folder / METADATA_FILE).write_text(json.dumps(
        {**meta, "output_names": ["end_logits", "start_logits"]}))
    feeds = _feeds(tiny_model_dir)
    expected = load_engine("onnx", tiny_model_dir, threads=1).run(feeds)
    mask = feeds["attention_mask"].astype(bool)
    for kind in ("onnx", "pytorch"):
        got = load_engine(kind, folder, threads=1).run(feeds)
        for name in ("start_logits", "end_logits"):
            np.testing.assert_allclose(got[name][mask], expected[name][mask], atol=1e-4)


@pytest.mark.parametrize("kind", ["onnx", "pytorch"])
def test_explicit_cuda_without_gpu_is_a_clear_error(tiny_model_dir: Path, kind: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="cuda"):
        load_engine(kind, tiny_model_dir, device="cuda")


def test_missing_model_dir_says_to_run_prepare_model(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="prepare_model.py"):
        load_engine("onnx", tmp_path)


def test_unknown_metadata_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / METADATA_FILE).write_text(json.dumps({"format": 99}))
    with pytest.raises(ModelDirError, match="format"):
        load_model_info(tmp_path)


@pytest.mark.parametrize("edit, why", [
    ({"meaningful": "false"}, "meaningful must be true or false, not 'false'"),
    ({"labels": [0, 1]}, "labels must be null or a non-empty list of strings"),
    ({"input_names": "input_ids"}, "input_names must be a non-empty list of strings"),
    ({"max_seq_len": True}, "max_seq_len must be a positive integer"),
    ({"model_name": None}, "model_name must be a string"),
])
def test_serving_json_fields_of_the_wrong_type_are_refused_naming_file_and_field(
        tiny_model_dir: Path, tmp_path: Path, edit: dict, why: str) -> None:
    """A string "false" made a model meaningful; other types failed later, naming nothing."""
    meta = json.loads((tiny_model_dir / METADATA_FILE).read_text())
    (tmp_path / METADATA_FILE).write_text(json.dumps({**meta, **edit}))
    with pytest.raises(ModelDirError, match=f"serving.json: .*{why}"):
        load_model_info(tmp_path)


def test_unknown_engine_type_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        load_engine("tensorrt", tiny_model_dir)


def test_check_outputs_rejects_a_missing_row() -> None:
    feeds = {"input_ids": np.zeros((3, 4), dtype=np.int64)}
    with pytest.raises(ValueError, match="2 rows for 3"):
        check_outputs(feeds, {"start_logits": np.zeros((2, 4), dtype=np.float32)})


def test_pytorch_engines_load_concurrently_in_session_threads(tiny_model_dir: Path) -> None:
    import threading

    errors: list[BaseException] = []

    def load() -> None:
        try:
            load_engine("pytorch", tiny_model_dir, threads=1)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []


@pytest.mark.parametrize("kind", ["onnx", "pytorch"])
def test_served_engines_give_the_pipelines_answers(tiny_model_dir: Path, kind: str) -> None:
    """The path the server runs (QATask + a real engine on the exported folder) answers exactly as
    transformers' pipeline does on the same weights, one request at a time and batched: asked
    live where the installed transformers has the pipeline, else its stored answers for these
    weights (tests/qa_reference.py)."""
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    from tasks.qa import QATask
    from tests.qa_reference import has_qa_pipeline, load_reference, weights_digest
    from tests.test_qa_agreement import CASES

    model = AutoModelForQuestionAnswering.from_pretrained(tiny_model_dir)
    if has_qa_pipeline():
        from transformers import pipeline

        reader = pipeline("question-answering", model=model,
                          tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir))
        reference = [reader(question=question, context=context) for question, context in CASES]
    else:
        stored = load_reference()["bert-0/defaults"]  # the tiny model's seed, default windows
        assert weights_digest(model) == stored.weights, (
            "the tiny model's weights are not the ones the pipeline's answers were stored for")
        assert [(case.question, case.context) for case in stored.cases] == CASES
        reference = [case.answers["squad1"] for case in stored.cases]
    task = QATask.from_dir(tiny_model_dir)
    engine = load_engine(kind, tiny_model_dir, threads=1)
    features = [task.preprocess(q, c) for q, c in CASES]
    batched = task.answer_batch(features, engine.run(task.collate(features)))
    for (question, _), feature, together, expected in zip(CASES, features, batched, reference,
                                                          strict=True):
        alone = task.answer_batch([feature], engine.run(task.collate([feature])))[0]
        for ours in (alone, together):
            assert (ours["answer"], ours["start"], ours["end"]) == (
                expected["answer"], expected["start"], expected["end"]), question
            assert ours["score"] == pytest.approx(expected["score"], rel=1e-3, abs=1e-6)


def test_a_zero_engine_server_answers_and_says_its_answers_mean_nothing(
        tiny_model_dir: Path) -> None:
    from client import Client
    from server import InferenceServer, ServerConfig

    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), inference_engine_type="zero",
                          num_inference_sessions=1)
    with InferenceServer(config) as srv, Client(*srv.address) as client:
        answer = client.answer("Who wrote it?", "Ada Lovelace wrote the notes in 1843.",
                               timeout=30)
        assert set(answer) == {"answer", "score", "start", "end"}
        model = client.stats()["model"]
        assert model["meaningful"] is False and "zero" in model["warning"]
        assert "zero-cost engine" in client.stats()["engine"]["description"]


def test_the_cpu_onnx_engine_is_shared_by_a_model_s_sessions_and_runs_them_side_by_side(
        tiny_model_dir: Path) -> None:
    """One engine (one copy of the weights) for every session: batches from two threads at once
    give what each gives alone, and the engine closes with its last user."""
    import threading

    from engines.sharing import SharedEngines

    engines = SharedEngines(lambda: load_engine("onnx", tiny_model_dir, device="cpu",
                                                threads=2))
    first, second = engines.acquire(), engines.acquire()
    assert first is second and engines.shared is first and first.shareable
    feeds = _feeds(tiny_model_dir)
    alone = first.run(feeds)
    together: list[dict[str, np.ndarray]] = []
    threads = [threading.Thread(target=lambda: together.extend(first.run(feeds)
                                                                for _ in range(20)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(together) == 40
    for outputs in together:
        for name in alone:
            np.testing.assert_allclose(alone[name], outputs[name], atol=1e-5)
    # the spinning threads stop as each run ends
    options = first.session.get_session_options()
    assert [options.get_session_config_entry(key) for key in (
        "session.intra_op.allow_spinning", "session.force_spinning_stop")] == ["1", "1"]
    engines.release(first)
    assert engines.shared is first  # the other session still runs it
    engines.release(second)
    assert engines.shared is None
    assert engines.acquire() is not first  # the next session loads afresh


def test_an_engine_that_cannot_be_shared_is_loaded_once_per_session(
        tiny_model_dir: Path) -> None:
    from engines.sharing import SharedEngines

    engines = SharedEngines(lambda: load_engine("zero", tiny_model_dir))
    first, second = engines.acquire(), engines.acquire()
    assert first is not second and engines.shared is None


def test_a_lone_batch_gets_every_core_and_a_crowded_one_its_share(tiny_model_dir: Path) -> None:
    crowded = [False]
    engine = load_engine("onnx", tiny_model_dir, device="cpu", threads=1, lone_threads=2,
                         crowded=lambda: crowded[0])
    feeds = _feeds(tiny_model_dir)
    alone = engine.run(feeds)
    assert engine.lone_runs == 1 and "2 for a lone batch" in engine.describe()
    crowded[0] = True
    shared = engine.run(feeds)
    assert engine.lone_runs == 1  # with company it kept to its own thread
    for name in alone:  # the same model either way
        np.testing.assert_allclose(alone[name], shared[name], atol=1e-5)
    # the lone session's threads spin while a batch runs and stop as it ends
    lone = engine.lone_session.get_session_options()
    assert [lone.get_session_config_entry(key) for key in (
        "session.intra_op.allow_spinning", "session.force_spinning_stop")] == ["1", "1"]


def test_only_engines_that_share_the_cores_get_a_lone_layout() -> None:
    import os

    from settings.server_config import ServerConfig

    cores = os.cpu_count() or 1
    shared = ServerConfig(num_inference_sessions=2)
    assert shared.lone_threads() == (cores if shared.engine_threads() < cores else 0)
    assert ServerConfig(threads_per_session=1).lone_threads() == 0  # set by hand: kept
    assert ServerConfig(workers=2).lone_threads() == 0  # across processes: no one can tell


def test_a_session_s_engine_gets_the_lone_layout_from_its_queue(tiny_model_dir: Path) -> None:
    """The server's own engine factory hands the engine its queue's ``crowded``: an empty
    queue (falsy: it has a length) must still count as one."""
    from scheduling.queue import WorkQueue
    from settings.server_config import ServerConfig
    from workers.local import default_engine_factory

    config = ServerConfig(model_dir=str(tiny_model_dir), num_inference_sessions=2,
                          threads_per_session=0)
    queue = WorkQueue()
    engine = default_engine_factory(config, "cpu", queue)()
    assert engine.lone_threads == config.lone_threads()
    if config.lone_threads():  # a machine of more cores than one session's threads
        engine.run(_feeds(tiny_model_dir))
        assert engine.lone_runs == 1  # nothing else queued or running: every core


def test_an_idle_onnx_engine_gives_back_what_its_largest_batch_took(
        tiny_model_dir: Path) -> None:
    """The arena keeps a big batch's working memory until ``release_memory`` (the idle
    watcher's call) shrinks it; the engine still answers the same afterwards."""
    from telemetry.memory import resident_mb, trim_heap

    engine = load_engine("onnx", tiny_model_dir, device="cpu", threads=1)
    feeds = _feeds(tiny_model_dir)
    before = engine.run(feeds)
    big = dummy_feeds(engine.input_names, 64, 512)  # attention alone: 64 x 2 x 512 x 512 floats
    engine.run(big)
    trim_heap()
    held = resident_mb()
    engine.release_memory()
    trim_heap()
    released = resident_mb()
    assert held is not None and released is not None
    assert held - released > 50, (held, released)
    after = engine.run(feeds)
    for name in before:
        np.testing.assert_allclose(before[name], after[name], atol=1e-6)
