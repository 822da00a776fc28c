"""The ONNX engine's GPU paths, on the CPU: provider order and its report, and I/O binding."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from engines.onnx_engine import OnnxEngine
from engines.onnx_providers import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    TENSORRT_PROVIDER,
    choose_providers,
    provider_report,
)

ALL = [TENSORRT_PROVIDER, CUDA_PROVIDER, CPU_PROVIDER]


def test_providers_go_tensorrt_then_cuda_then_cpu(tmp_path: Path) -> None:
    chain = choose_providers("cuda:1", model_dir=tmp_path, fp16=True, available=ALL,
                             tensorrt=True)
    assert [p if isinstance(p, str) else p[0] for p in chain] == ALL
    trt, cuda = dict(chain[0][1]), dict(chain[1][1])  # type: ignore[index]
    assert trt["device_id"] == cuda["device_id"] == 1 and trt["trt_fp16_enable"] is True
    assert trt["trt_engine_cache_enable"] is True
    assert trt["trt_engine_cache_path"] == str(tmp_path / "trt_cache")  # kept with the model
    no_trt = choose_providers("auto", available=[CUDA_PROVIDER, CPU_PROVIDER])
    assert [p if isinstance(p, str) else p[0] for p in no_trt] == [CUDA_PROVIDER, CPU_PROVIDER]
    no_libs = choose_providers("auto", available=ALL, tensorrt=False)  # TensorRT would not load
    assert [p if isinstance(p, str) else p[0] for p in no_libs] == [CUDA_PROVIDER, CPU_PROVIDER]
    assert choose_providers("cpu", available=ALL) == [CPU_PROVIDER]
    assert choose_providers("auto", available=[CPU_PROVIDER]) == [CPU_PROVIDER]
    with pytest.raises(RuntimeError, match="install onnxruntime-gpu"):
        choose_providers("cuda", available=[CPU_PROVIDER])


def test_a_model_folder_that_cannot_be_written_caches_tensorrt_engines_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compose.yaml mounts saved_models read-only; TensorRT fails to create its cache there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "not-a-folder").write_text("")  # nothing can be made under a file (even by root)
    model_dir = tmp_path / "not-a-folder" / "qa"
    chain = choose_providers("cuda", model_dir=model_dir, available=ALL, tensorrt=True)
    cache = Path(dict(chain[0][1])["trt_engine_cache_path"])  # type: ignore[index]
    assert cache.is_dir() and cache.is_relative_to(tmp_path / "cache" / "qa-server")


def test_the_report_says_why_each_missing_provider_is_missing() -> None:
    asked = choose_providers("cuda", available=ALL, tensorrt=True)
    line = provider_report(asked, [CUDA_PROVIDER, CPU_PROVIDER], ALL)
    assert line.startswith("execution providers: asked TensorRT -> CUDA -> CPU; running CUDA -> CPU")
    assert "TensorRT: could not start" in line and "CUDA:" not in line.split("(", 1)[1]
    plain = provider_report([CPU_PROVIDER], [CPU_PROVIDER], [CPU_PROVIDER])
    assert "TensorRT: not in this onnxruntime build" in plain
    assert "CUDA: not in this onnxruntime build" in plain
    assert "not asked for" in provider_report([CPU_PROVIDER], [CPU_PROVIDER], ALL)
    without_libs = choose_providers("cuda", available=ALL, tensorrt=False)
    assert "TensorRT: its libraries (libnvinfer.so.10) do not load" in \
        provider_report(without_libs, [CUDA_PROVIDER, CPU_PROVIDER], ALL)


def test_the_engine_says_nothing_of_gpu_runtimes_a_cpu_machine_cannot_have(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without a GPU the providers' report is at DEBUG only: nothing at INFO or above names
    TensorRT or CUDA."""
    with caplog.at_level(logging.DEBUG, logger="engines.onnx_engine"):
        engine = OnnxEngine(tiny_model_dir, device="auto", intra_op_threads=1)
    assert engine.device == "cpu" and engine.binder is None  # binding only where CUDA runs
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("execution providers: asked CPU; running CPU") for m in debug)
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not any("TensorRT" in m or "CUDA" in m for m in loud), loud


def test_a_gpu_provider_asked_for_but_not_running_is_said_in_one_line() -> None:
    from engines.onnx_providers import provider_note

    assert provider_note([CPU_PROVIDER], [CPU_PROVIDER]) == ""
    chain = choose_providers("cuda", available=ALL, tensorrt=True)
    note = provider_note(chain, [CUDA_PROVIDER, CPU_PROVIDER])
    assert note.startswith("TensorRT asked for but not running (running CUDA -> CPU")
    assert provider_note(chain, [CUDA_PROVIDER, TENSORRT_PROVIDER, CPU_PROVIDER]) == ""


def test_io_binding_gives_the_same_logits_and_keeps_buffers_per_shape(
        tiny_model_dir: Path) -> None:
    bound = OnnxEngine(tiny_model_dir, device="cpu", intra_op_threads=1, io_binding=True)
    plain = OnnxEngine(tiny_model_dir, device="cpu", intra_op_threads=1)
    assert bound.binder is not None and "I/O binding" in bound.describe()
    rng = np.random.default_rng(0)
    sent = []
    for rows, length in [(1, 16), (3, 32), (1, 16), (3, 32), (2, 16)]:
        feeds = {"input_ids": rng.integers(1, 1000, (rows, length)),
                 "attention_mask": np.ones((rows, length), dtype=np.int64),
                 "token_type_ids": rng.integers(0, 2, (rows, length))}
        sent.append((feeds, {name: value.copy() for name, value in feeds.items()}))
        got, expected = bound.run(feeds), plain.run(feeds)
        for name in ("start_logits", "end_logits"):
            assert np.array_equal(got[name], expected[name]), (rows, length, name)
    assert bound.binder.allocations == 3  # one set of buffers per shape, reused after
    for feeds, before in sent:  # the caller's arrays are never written into
        assert all(np.array_equal(feeds[name], before[name]) for name in feeds)


def test_with_no_writable_folder_at_all_tensorrt_runs_without_a_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))  # a read-only home
    chain = choose_providers("cuda", model_dir=tmp_path / "file" / "qa", available=ALL,
                             tensorrt=True)
    trt = dict(chain[0][1])  # type: ignore[index]
    assert trt["trt_engine_cache_enable"] is False and "trt_engine_cache_path" not in trt
