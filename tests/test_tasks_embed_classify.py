"""The embed and classify tasks end to end at the task + engine level: features -> collate ->
ONNX Runtime and PyTorch engines -> split -> postprocess, on tiny real models built here."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines import load_engine
from engines.model_dir import load_model_info
from protocol.errors import BadRequest, EngineError
from protocol.messages import ClassifyRequest, EmbedRequest
from settings.server_config import ServerConfig
from tasks import load_task
from tasks.classify import ClassifyTask
from tasks.embed import EmbedTask
from tasks.text import TextEncoder, fitting_buckets
from tests.text_models import TINY_LABELS, build_tiny_classify_dir, build_tiny_embed_dir

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "A cat sat on the mat.",
    "Zürich liegt am Zürichsee; die Stadt hat viele Brücken.",
    "東京は日本の首都です。",
    "The river flows north for 6,650 km, through eleven countries, into the Mediterranean "
    "Sea, past temples, farms and cities, and it floods every summer.",
    "ok",
    "Python was created by Guido van Rossum and first released in 1991.",
]
LONG_TEXT = " ".join(f"word{i} and more" for i in range(400))  # far over 128 tokens
EMBED_MAX = 128  # the tiny embed model's max_seq_len (as sentence_bert_config would give it)


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_embed_dir(tmp_path_factory.mktemp("embed"), max_seq_len=EMBED_MAX)


@pytest.fixture(scope="module")
def classify_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classify_dir(tmp_path_factory.mktemp("classify"))


def task_for(model_dir: Path, **settings: Any) -> Any:
    """The task the server would build for ``model_dir`` under ``settings``."""
    return load_task(model_dir, load_model_info(model_dir), ServerConfig(**settings))


def serve(task: Any, engine: Any, requests: list[Any]) -> list[dict[str, Any]]:
    """One batch through the task and the engine, as a session runs it."""
    batch = [task.features(request) for request in requests]
    outputs = engine.run(task.collate(batch))
    return [task.postprocess(f, *arrays)
            for f, arrays in zip(batch, task.split_outputs(batch, outputs), strict=True)]


def embed(texts: list[str], request_id: int = 1) -> EmbedRequest:
    return EmbedRequest(id=request_id, texts=tuple(texts))


def reference_embeddings(model_dir: Path, texts: list[str], max_len: int) -> np.ndarray:
    """Mean pooling and L2 norm computed here with transformers, for comparison."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_len,
                    return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(mean, dim=1).numpy()


# --------------------------------------------------------------------------- embed


def test_the_registry_builds_each_task_from_serving_json(embed_dir: Path,
                                                         classify_dir: Path) -> None:
    embed_task, classify_task = task_for(embed_dir), task_for(classify_dir)
    assert isinstance(embed_task, EmbedTask) and isinstance(classify_task, ClassifyTask)
    assert (embed_task.op, embed_task.output_names) == ("embed", ("embeddings",))
    assert (classify_task.op, classify_task.output_names) == ("classify", ("logits",))
    assert embed_task.max_seq_len == EMBED_MAX  # the model's, below the server's 384
    assert task_for(embed_dir, max_seq_len=64).max_seq_len == 64  # the server's, below it
    assert classify_task.labels == TINY_LABELS
    info = json.loads((embed_dir / "serving.json").read_text())
    assert info["task"] == "embed" and info["embedding_dim"] == 32
    assert info["output_names"] == ["embeddings"] and info["labels"] is None


@pytest.mark.parametrize("kind", ["onnx", "pytorch"])
def test_embeddings_are_unit_vectors_equal_to_transformers_mean_pooling(
        embed_dir: Path, kind: str) -> None:
    task = task_for(embed_dir)
    engine = load_engine(kind, embed_dir, threads=1)
    assert engine.output_names == ("embeddings",)
    assert kind != "pytorch" or engine.graph == "traced"  # not fallen back to eager
    results = serve(task, engine, [embed(TEXTS[:2], 1), embed(TEXTS[2:], 2)])
    vectors = np.array([v for result in results for v in result["embeddings"]])
    assert [result["dim"] for result in results] == [32, 32] and vectors.shape == (6, 32)
    assert all(isinstance(x, float) for x in results[0]["embeddings"][0])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors, reference_embeddings(embed_dir, TEXTS, EMBED_MAX),
                               atol=1e-5)


@pytest.mark.parametrize("buckets", [None, "16,32"])
def test_a_batch_of_mixed_lengths_gives_the_vectors_of_one_by_one(embed_dir: Path,
                                                                   buckets: str | None) -> None:
    task = task_for(embed_dir, length_buckets=buckets)
    engine = load_engine("onnx", embed_dir, threads=1)
    texts = [*TEXTS, LONG_TEXT]
    alone = [serve(task, engine, [embed([text])])[0]["embeddings"][0] for text in texts]
    batch = serve(task, engine, [embed([text], n) for n, text in enumerate(texts)])
    together = [result["embeddings"][0] for result in batch]
    np.testing.assert_allclose(together, alone, atol=1e-5)
    in_one = serve(task, engine, [embed(texts)])[0]["embeddings"]  # one request, many rows
    np.testing.assert_allclose(in_one, alone, atol=1e-5)


def test_rows_are_texts_and_batches_pad_to_the_longest_or_its_bucket(embed_dir: Path) -> None:
    task = task_for(embed_dir, length_buckets="16,32,1000")
    assert task.buckets == (16, 32, EMBED_MAX)  # 1000 is longer than the model: left out
    short, longer = task.features(embed(["a b", "c"])), task.features(embed([TEXTS[1]]))
    assert (short.rows, short.max_len) == (2, 4) and short.lengths.tolist() == [4, 3]
    assert task.collate([short])["input_ids"].shape == (2, 16)
    feeds = task.collate([short, longer])
    assert feeds["input_ids"].shape == (3, 32) and feeds["attention_mask"][1].sum() == 3
    plain = task_for(embed_dir)
    assert plain.buckets == () and plain.collate([short])["input_ids"].shape == (2, 4)
    assert fitting_buckets([64, 128, 256, 384], 256) == (64, 128, 256)


def test_too_many_tokens_are_cut_to_max_seq_len_not_refused(embed_dir: Path) -> None:
    task = task_for(embed_dir)
    features = task.features(embed([LONG_TEXT, "short"]))
    assert features.max_len == EMBED_MAX and features.lengths.tolist() == [EMBED_MAX, 3]
    sep = task.encoder.tokenizer.token_to_id("[SEP]")
    assert features.input_ids[0, -1] == sep  # the special tokens are kept
    result = serve(task, load_engine("onnx", embed_dir, threads=1), [embed([LONG_TEXT])])[0]
    np.testing.assert_allclose(result["embeddings"][0],
                               reference_embeddings(embed_dir, [LONG_TEXT], EMBED_MAX)[0],
                               atol=1e-5)


@pytest.mark.parametrize("texts", [[], ["   "], ["fine", ""], ["fine", 3]])
def test_texts_the_protocol_would_refuse_are_refused_by_the_task_too(embed_dir: Path,
                                                                    texts: list[Any]) -> None:
    with pytest.raises(BadRequest):
        task_for(embed_dir).features(embed(texts))


def test_a_text_of_nothing_but_dropped_characters_is_refused_as_qa_refuses_it(
        embed_dir: Path) -> None:
    """Zero-width, control and lone combining characters leave no tokens: [CLS] [SEP] alone
    would give the same vector for all of them."""
    task = task_for(embed_dir)
    for nothing in ("\u200b\u200d", "\x00", "\u0301"):
        with pytest.raises(BadRequest, match="text 1 has no tokens"):
            task.features(embed(["fine", nothing]))
    assert task.features(embed(["fine", "\u200bok"])).rows == 2


def test_encoding_from_many_threads_at_once_gives_the_same_rows(embed_dir: Path) -> None:
    task = task_for(embed_dir, max_seq_len=24)
    texts = [*TEXTS, LONG_TEXT] * 20
    expected = [task.features(embed([text])).input_ids.tolist() for text in texts]
    got: dict[int, list[Any]] = {}

    def work(offset: int) -> None:
        got[offset] = [task.features(embed([text])).input_ids.tolist() for text in texts]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(rows == expected for rows in got.values()) and len(got) == 8


def test_wrong_output_shapes_fail_the_batch_or_the_request(embed_dir: Path) -> None:
    task = task_for(embed_dir)
    batch = [task.features(embed(["a", "b"])), task.features(embed(["c"]))]
    with pytest.raises(ValueError):
        task.split_outputs(batch, {"embeddings": np.zeros((2, 32), dtype=np.float32)})
    with pytest.raises(ValueError):
        task.split_outputs(batch, {"logits": np.zeros((3, 32), dtype=np.float32)})
    with pytest.raises(ValueError):
        task.postprocess(batch[0], np.zeros((1, 32), dtype=np.float32))
    with pytest.raises(ValueError):
        TextEncoder(task.encoder.tokenizer, 2)  # no room for a token beside [CLS] [SEP]


def test_a_vector_holding_nan_or_an_infinity_is_an_engine_error(embed_dir: Path) -> None:
    task = task_for(embed_dir)
    features = task.features(embed(["a", "b"]))
    vectors = np.full((2, 32), 0.125, dtype=np.float32)
    assert task.postprocess(features, vectors)["dim"] == 32
    for bad in (np.nan, np.inf):
        vectors[1, 5] = bad
        with pytest.raises(EngineError, match="embeddings for this request hold NaN"):
            task.postprocess(features, vectors)


# --------------------------------------------------------------------------- classify


@pytest.mark.parametrize("kind", ["onnx", "pytorch"])
def test_classify_gives_a_label_of_the_config_and_probabilities_summing_to_1(
        classify_dir: Path, kind: str) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    task = task_for(classify_dir)
    engine = load_engine(kind, classify_dir, threads=1)
    assert kind != "pytorch" or engine.graph == "traced"  # not fallen back to eager
    requests = [ClassifyRequest(id=n, text=text) for n, text in enumerate([*TEXTS, LONG_TEXT])]
    results = serve(task, engine, requests)
    tokenizer = AutoTokenizer.from_pretrained(classify_dir)
    model = AutoModelForSequenceClassification.from_pretrained(classify_dir).eval()
    for request, result in zip(requests, results, strict=True):
        assert set(result) == {"label", "score", "scores"}
        assert tuple(result["scores"]) == TINY_LABELS and result["label"] in TINY_LABELS
        assert sum(result["scores"].values()) == pytest.approx(1.0, abs=1e-9)
        assert result["score"] == max(result["scores"].values())
        assert result["scores"][result["label"]] == result["score"]
        enc = tokenizer(request.text, truncation=True, max_length=512, return_tensors="pt")
        with torch.inference_mode():
            expected = torch.softmax(model(**enc).logits[0], dim=-1).numpy()
        np.testing.assert_allclose(list(result["scores"].values()), expected, atol=1e-5)


def test_classify_refuses_a_blank_text_and_checks_the_logits(classify_dir: Path) -> None:
    task = task_for(classify_dir)
    with pytest.raises(BadRequest):
        task.features(ClassifyRequest(id=1, text=" \n"))
    for nothing in ("\u200b\u200d", "\x00", "\u0301"):  # characters the tokenizer drops
        with pytest.raises(BadRequest, match="text 0 has no tokens"):
            task.features(ClassifyRequest(id=1, text=nothing))
    features = task.features(ClassifyRequest(id=1, text="good"))
    assert features.rows == 1
    with pytest.raises(ValueError, match="4 logits for 3 labels"):
        task.postprocess(features, np.zeros((1, 4), dtype=np.float32))
    for bad in ([0.0, np.nan, 1.0], [0.0, np.inf, 1.0], [-np.inf] * 3):
        with np.errstate(invalid="ignore"), \
                pytest.raises(EngineError, match="logits for this request hold NaN"):
            task.postprocess(features, np.array([bad], dtype=np.float32))
    ruled_out = task.postprocess(features, np.array([[0.0, -np.inf, 1.0]], dtype=np.float32))
    assert ruled_out["scores"][TINY_LABELS[1]] == 0.0 and ruled_out["label"] == TINY_LABELS[2]
    unlabelled = ClassifyTask(task.encoder)  # serving.json without labels
    result = unlabelled.postprocess(features, np.array([[0.0, 2.0]], dtype=np.float32))
    assert result["label"] == "LABEL_1" and set(result["scores"]) == {"LABEL_0", "LABEL_1"}
    with pytest.raises(ValueError):
        ClassifyTask(task.encoder, ["a", "a"])


# --------------------------------------------------------------------------- engines


def test_the_zero_engine_gives_each_task_outputs_of_its_shape(embed_dir: Path, classify_dir: Path,
                                                              tiny_model_dir: Path) -> None:
    feeds = {name: np.ones((5, 9), dtype=np.int64)
             for name in ("input_ids", "attention_mask", "token_type_ids")}
    embedded = load_engine("zero", embed_dir).run(feeds)
    assert list(embedded) == ["embeddings"] and embedded["embeddings"].shape == (5, 32)
    np.testing.assert_allclose(np.linalg.norm(embedded["embeddings"], axis=1), 1.0, atol=1e-5)
    classified = load_engine("zero", classify_dir).run(feeds)
    assert list(classified) == ["logits"] and classified["logits"].shape == (5, 3)
    answered = load_engine("zero", tiny_model_dir).run(feeds)
    assert {name: value.shape for name, value in answered.items()} == {
        "start_logits": (5, 9), "end_logits": (5, 9)}
    zero = load_engine("zero", classify_dir)
    result = serve(task_for(classify_dir), zero, [ClassifyRequest(id=1, text="fine")])[0]
    assert result["label"] in TINY_LABELS


def test_fp16_exports_of_embed_and_classify_are_checked_by_their_own_answers(
        embed_dir: Path, classify_dir: Path, tmp_path: Path) -> None:
    import shutil

    from preparation.fp16 import export_fp16

    cases = [("Who wrote it?", "Ada wrote the notes in 1843."), ("Where?", TEXTS[1])]
    for source in (embed_dir, classify_dir):
        folder = tmp_path / source.name
        shutil.copytree(source, folder)
        info = export_fp16(folder, min_agreement=0.0, cases=cases)
        assert info.fp16 is not None and info.fp16["cases"] == 4  # every text of the cases
        assert info.fp16["max_abs_logit_diff"] < 0.05
        if info.task == "embed":
            assert info.fp16["agreement"] == 1.0  # cosine >= 0.999 to fp32's
        engine = load_engine("onnx", folder, precision="fp16", threads=1)
        assert engine.precision == "fp16"
        assert serve(task_for(folder), engine, [embed(["x y"])] if info.task == "embed"
                     else [ClassifyRequest(id=1, text="x y")])


def test_onnx_serving_of_text_tasks_imports_neither_transformers_nor_torch(
        embed_dir: Path, classify_dir: Path) -> None:
    script = (
        "import sys\n"
        "from engines import load_engine\n"
        "from engines.model_dir import load_model_info\n"
        "from protocol.messages import ClassifyRequest, EmbedRequest\n"
        "from settings.server_config import ServerConfig\n"
        "from tasks import load_task\n"
        f"for folder, request in (({str(embed_dir)!r}, EmbedRequest(id=1, texts=('a b',))),\n"
        f"                        ({str(classify_dir)!r}, ClassifyRequest(id=2, text='a b'))):\n"
        "    task = load_task(folder, load_model_info(folder), ServerConfig())\n"
        "    batch = [task.features(request)]\n"
        "    out = load_engine('onnx', folder, threads=1).run(task.collate(batch))\n"
        "    print(task.postprocess(batch[0], *task.split_outputs(batch, out)[0]))\n"
        "print('transformers' in sys.modules, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "False"], done.stdout


# --------------------------------------------------------------------------- plug-in


def test_the_plug_in_task_of_docs_tasks_md_runs_as_written(
        classify_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from protocol.messages import TaskRequest, parse_request

    doc = (ROOT / "docs" / "tasks.md").read_text()
    code = doc.split("# mytasks/classify_many.py\n", 1)[1].split("```", 1)[0]
    package = tmp_path / "mytasks"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "classify_many.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = tmp_path / "many"
    shutil.copytree(classify_dir, folder)
    meta = json.loads((folder / "serving.json").read_text())
    meta["task"] = "mytasks.classify_many:ClassifyManyTask"
    (folder / "serving.json").write_text(json.dumps(meta))

    task = task_for(folder)
    assert (task.name, task.op) == ("classify_many", "classify_many")
    request = parse_request({"id": 1, "op": "classify_many", "texts": ["great film", "dull"]},
                            {"classify_many"})
    assert isinstance(request, TaskRequest) and request.fields == {"texts": ["great film",
                                                                              "dull"]}
    result = serve(task, load_engine("onnx", folder, threads=1), [request])[0]
    assert len(result["labels"]) == len(result["scores"]) == 2
    assert set(result["labels"]) <= set(TINY_LABELS)
    for bad in ({"texts": "one"}, {"texts": []}, {"texts": ["fine", " "]}, {}):
        with pytest.raises(BadRequest):
            task.features(TaskRequest(op="classify_many", id=2, fields=bad))
