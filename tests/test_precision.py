"""--precision and the fp16 export: checked against fp32, served on the CPU, fallbacks said."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from client import Client
from engines import load_engine
from engines.model_dir import METADATA_FILE, ModelDirError, load_model_info
from preparation.fp16 import FP16_FILE, Fp16ParityError, check_parity, export_fp16
from preparation.torch_fp16 import record_torch_check
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, nan_model_dir


@pytest.fixture(scope="module")
def fp16_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fp16") / "model"
    shutil.copytree(tiny_model_dir, folder)
    export_fp16(folder)
    return folder


def test_the_fp16_export_is_checked_against_fp32_and_recorded(fp16_dir: Path) -> None:
    meta = json.loads((fp16_dir / METADATA_FILE).read_text())["fp16"]
    assert meta["file"] == FP16_FILE and (fp16_dir / FP16_FILE).is_file()
    assert meta["agreement"] >= 0.99 and meta["agreeing"] <= meta["cases"] >= 50
    assert meta["checked_on"] == "cpu"  # no GPU on the test machines
    assert 0 < meta["max_abs_logit_diff"] < 0.05  # fp16 rounding: not zero, not large
    import onnx

    graph = onnx.load(str(fp16_dir / FP16_FILE)).graph
    assert onnx.TensorProto.FLOAT16 in {i.data_type for i in graph.initializer}  # fp16 weights
    # ONNX Runtime's optimizer fused the attention and the embeddings, whichever transformers
    # line exported the model (5.x's own attention masks are a shape it does not fuse)
    assert {"Attention", "EmbedLayerNormalization"} <= {node.op_type for node in graph.node}


def test_an_fp16_export_that_disagrees_is_not_kept(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    with pytest.raises(Fp16ParityError, match="not kept"):
        export_fp16(folder, min_agreement=1.01)  # no export can pass: the refusal path
    assert not (folder / FP16_FILE).exists()
    assert json.loads((folder / METADATA_FILE).read_text()).get("fp16") is None


def test_an_fp16_export_giving_nan_counts_as_disagreeing_not_as_a_crash(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    shutil.copy(nan_model_dir(tiny_model_dir, tmp_path / "nan") / "model.onnx", folder / FP16_FILE)
    info = load_model_info(folder)
    cases = [("Who?", "It will explode soon."), ("Who?", "Ann met Bob.")] * 2
    parity = check_parity(folder, info, cases)  # the fp16 file here: NaN on "explode"
    assert parity["cases"] == 4 and parity["agreeing"] <= 2
    assert parity["max_abs_logit_diff"] == float("inf")


def served(model_dir: Path, precision: str) -> tuple[list[dict[str, object]], str]:
    """Every helper question on every helper context, and the engine's description."""
    config = ServerConfig(port=0, model_dir=str(model_dir), num_inference_sessions=1,
                          precision=precision)
    with InferenceServer(config) as srv, Client(*srv.address) as client:
        futures = [client.submit(q, c) for q in QUESTIONS for c in CONTEXTS]
        replies = [future.result(timeout=60) for future in futures]
        engine = client.stats(timeout=30)["engine"]
    assert engine["precision"] in engine["description"]
    return replies, engine["description"]


def test_the_server_serves_the_fp16_model(fp16_dir: Path) -> None:
    full, full_engine = served(fp16_dir, "fp32")
    half, half_engine = served(fp16_dir, "fp16")
    assert "(fp32," in full_engine and "(fp16," in half_engine
    assert [(r["answer"], r["start"], r["end"]) for r in half] == \
        [(r["answer"], r["start"], r["end"]) for r in full]
    assert [r["score"] for r in half] != [r["score"] for r in full]  # really another model


def test_a_precision_that_cannot_be_honoured_is_said_and_falls_back(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cases = [("onnx", "fp16", "has no fp16 model"), ("onnx", "bf16", "no bf16 model"),
             ("pytorch", "fp16", "float16 only on CUDA")]
    for kind, precision, reason in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            engine = load_engine(kind, tiny_model_dir, device="cpu", threads=1,
                                 precision=precision)
        assert engine.precision == "fp32" and "(fp32," in engine.describe(), (kind, precision)
        assert any(reason in r.getMessage() and "running fp32" in r.getMessage()
                   for r in caplog.records), (kind, precision)
        engine.close()


def test_pytorch_runs_bf16_on_the_cpu(tiny_model_dir: Path) -> None:
    engine = load_engine("pytorch", tiny_model_dir, device="cpu", threads=1, precision="bf16")
    full = load_engine("pytorch", tiny_model_dir, device="cpu", threads=1)
    feeds = {name: np.ones((2, 16), dtype=np.int64) for name in engine.input_names}
    half, exact = engine.run(feeds), full.run(feeds)
    assert engine.precision == "bf16" and engine.graph == "traced"
    assert "(bf16, traced graph, sdpa attention," in engine.describe()
    assert half["start_logits"].dtype == np.float32
    assert np.allclose(half["start_logits"], exact["start_logits"], atol=0.1)
    assert not np.array_equal(half["start_logits"], exact["start_logits"])
    engine.close()
    full.close()


def test_the_benchmark_names_the_precision_each_raw_engine_ran(fp16_dir: Path,
                                                              tiny_model_dir: Path) -> None:
    from bench.bench import parse_args, server_flags
    from bench.mix import load_mix
    from bench.raw import raw_ceiling, raw_parallel

    pairs = load_mix("qa", None, 1)[:4]
    half = raw_ceiling("onnx", fp16_dir, pairs, [1], 2, 1, device="cpu", precision="fp16")
    lacking = raw_parallel("onnx", tiny_model_dir, pairs, 2, 2, device="cpu", precision="fp16")
    assert half[0]["layout"].endswith(", fp16")  # the fp16 model ran
    assert "fp16" not in lacking["layout"]  # no fp16 export there: fp32 ran, and says so
    args = parse_args(["--device", "cuda:1", "--precision", "fp16", "--server_args", "--workers 2"])
    assert server_flags(args) == ["--workers", "2", "--device", "cuda:1", "--precision", "fp16"]
    assert server_flags(parse_args([])) == []


def test_pytorch_at_half_precision_is_checked_against_fp32_and_recorded(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """prepare_model.py's check on a GPU (float16 on CUDA), run here in bfloat16 on the CPU."""
    folder = tmp_path / "qa"
    shutil.copytree(tiny_model_dir, folder)
    assert load_model_info(folder).torch_fp16 is None  # a folder prepared before: unchecked
    cases = list(zip(QUESTIONS, CONTEXTS, strict=False))
    info = record_torch_check(folder, cases=cases, device="cpu", precision="bf16")
    check = json.loads((folder / METADATA_FILE).read_text())["torch_fp16"]
    assert check == info.torch_fp16 and check["min_agreement"] == 0.99
    assert (check["precision"], check["checked_on"], check["cases"]) == ("bf16", "cpu", len(cases))
    assert 0 < check["max_abs_logit_diff"] < 0.1  # bfloat16 rounding: not zero, not large
    assert check["agrees"] is (check["agreement"] >= 0.99)
    refused = record_torch_check(folder, min_agreement=1.01, cases=cases[:2], device="cpu",
                                 precision="bf16").torch_fp16 or {}
    assert refused["agrees"] is False and refused["cases"] == 2  # no share passes 101%


def test_the_pytorch_check_refuses_a_precision_the_device_cannot_run(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "qa"
    shutil.copytree(tiny_model_dir, folder)
    with pytest.raises(ValueError, match="cannot run fp16 on cpu"):
        record_torch_check(folder, cases=[(QUESTIONS[0], CONTEXTS[0])], device="cpu",
                           precision="fp16")
    meta = json.loads((folder / METADATA_FILE).read_text())
    assert meta.get("torch_fp16") is None
    (folder / METADATA_FILE).write_text(json.dumps({**meta, "torch_fp16": "yes"}))
    with pytest.raises(ModelDirError, match="torch_fp16 must be an object or null"):
        load_model_info(folder)
