"""The engine ``python server.py`` chooses where its settings leave it open
(workers/engine_choice.py), the layout that follows from it, and the precision that the PyTorch
check prepare_model.py records (preparation/torch_fp16.py; run here on the CPU in bfloat16)
decides."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from engines.devices import torch_cuda_gpus
from preparation.torch_fp16 import record_torch_check
from dispatch.registry import setting_registry
from settings.config_file import with_config_file
from settings.server_config import (
    ServerConfig,
    config_from_args,
    flags_of,
    full_parser,
    given_settings,
)
from tests.helpers import CONTEXTS, QUESTIONS
from tests.test_server_process import start_server
from workers.engine_choice import EngineChoice, choose_engine
from workers.layout import choose_layout

CASES = list(zip(QUESTIONS, CONTEXTS, strict=False))


@pytest.fixture(scope="module")
def repository(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two models, each with what PyTorch loads (config.json, model.safetensors)."""
    root = tmp_path_factory.mktemp("repository")
    for name in ("qa", "other"):
        shutil.copytree(tiny_model_dir, root / name)
    return root


def choice(argv: list[str], model_dir: Path, gpus: int) -> EngineChoice:
    """What server.py chooses under the command line ``argv`` (a ``--config`` file's settings
    read as server.py reads them) with ``gpus`` CUDA devices."""
    registry = setting_registry()
    parser = full_parser(None, registry)
    args = vars(parser.parse_args(with_config_file(argv, flags_of(parser))))
    del args["config"], args["log_level"]
    config = config_from_args(parser, {**args, "model_dir": str(model_dir)}, registry)
    return choose_engine(config, given_settings(argv, registry), gpus=gpus)


def test_a_gpu_box_serves_pytorch_fp16_with_cuda_graphs_in_the_executor_layout(
        repository: Path) -> None:
    chosen = choice([], repository, gpus=1)
    config = chosen.config
    assert (config.inference_engine_type, config.precision, config.pytorch_graph) == \
        ("pytorch", "fp16", "auto")  # auto: CUDA graphs on CUDA
    assert chosen.why == "pytorch fp16 with CUDA graphs, measured fastest on a GPU (docs/gpu.md)"
    layout = choose_layout(config, set(), cores=16, gpus=1)
    assert (layout.config.executors, layout.config.workers, layout.config.cuda_devices) == \
        ("on", 4, "0")
    assert layout.why.startswith("one executor per GPU (cuda:0)")


def test_a_cpu_only_machine_keeps_onnx_fp32_in_one_process(repository: Path) -> None:
    chosen = choice([], repository, gpus=0)
    assert (chosen.config.inference_engine_type, chosen.config.precision) == ("onnx", "fp32")
    assert chosen.why == "onnx fp32, the default without a GPU; --inference_engine_type to choose"
    layout = choose_layout(chosen.config, set(), cores=16, gpus=0)
    assert (layout.config.workers, layout.config.executors) == (1, "off")


def test_the_flags_win_over_the_choice(repository: Path) -> None:
    onnx = choice(["--inference_engine_type", "onnx"], repository, gpus=1)
    assert onnx.config.inference_engine_type == "onnx" and onnx.config.precision == "fp32"
    assert onnx.why == "onnx fp32, as the settings say"
    full = choice(["--precision", "fp32"], repository, gpus=1).config
    assert (full.inference_engine_type, full.precision) == ("pytorch", "fp32")
    traced = choice(["--pytorch_graph", "traced"], repository, gpus=1)
    assert traced.why.startswith("pytorch fp16, traced, measured fastest")
    on_cpu = choice(["--device", "cpu"], repository, gpus=1)
    assert on_cpu.config.inference_engine_type == "onnx"
    assert on_cpu.why == "onnx fp32, the default (--device cpu)"
    front_end = choose_engine(ServerConfig(model_dir=str(repository), broker="redis://x:1/0"),
                              set(), gpus=1)
    assert front_end.config.inference_engine_type == "onnx"
    assert front_end.why == ""  # it runs no engine: its log has no engine line


def test_a_config_file_that_names_the_engine_wins(repository: Path, tmp_path: Path) -> None:
    settings = tmp_path / "tuned.toml"
    settings.write_text('inference_engine_type = "onnx"\n')
    chosen = choice(["--config", str(settings)], repository, gpus=1)
    assert chosen.config.inference_engine_type == "onnx"
    assert chosen.why.endswith("as the settings say")
    settings.write_text('precision = "bf16"\n')  # the engine still chosen, the precision kept
    kept = choice(["--config", str(settings)], repository, gpus=1).config
    assert (kept.inference_engine_type, kept.precision) == ("pytorch", "bf16")


def test_a_model_pytorch_cannot_load_keeps_the_server_on_onnx_and_says_which(
        repository: Path, tmp_path: Path) -> None:
    root = tmp_path / "repository"
    shutil.copytree(repository, root)
    (root / "other" / "model.safetensors").unlink()
    chosen = choice([], root, gpus=1)
    assert chosen.config.inference_engine_type == "onnx"
    assert chosen.why == "onnx fp32, the default: model other has no model.safetensors for " \
        "PyTorch"
    assert choice([], root / "qa", gpus=1).config.inference_engine_type == "pytorch"
    worker = choose_engine(ServerConfig(model_dir=str(root), role="worker", models="qa"), set(),
                           gpus=1)  # a --role worker of --models qa holds qa only
    assert worker.config.inference_engine_type == "pytorch"


def test_a_model_whose_fp16_disagreed_on_the_gpu_serves_fp32(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "qa"
    shutil.copytree(tiny_model_dir, folder)
    record_torch_check(folder, min_agreement=1.01, cases=CASES[:2], device="cpu",
                       precision="bf16")  # no share can pass: the disagreement path
    chosen = choice([], folder, gpus=1)
    assert (chosen.config.inference_engine_type, chosen.config.precision) == ("pytorch", "fp32")
    assert chosen.why == "pytorch fp32 with CUDA graphs: fp16 disagreed with fp32 on model qa " \
        "(its serving.json)"
    assert choice(["--precision", "fp16"], folder, gpus=1).config.precision == "fp16"
    record_torch_check(folder, min_agreement=0.0, cases=CASES[:2], device="cpu",
                       precision="bf16")
    assert choice([], folder, gpus=1).config.precision == "fp16"


def test_the_server_says_which_engine_it_chose_and_why(tiny_model_dir: Path) -> None:
    proc, _, lines = start_server("--model_dir", str(tiny_model_dir))
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    log = "".join(lines)
    if torch_cuda_gpus():  # a machine with a GPU runs this test too
        assert "engine: pytorch fp16 with CUDA graphs, measured fastest on a GPU" in log, log
        return
    assert "INFO server: engine: onnx fp32, the default without a GPU; " \
        "--inference_engine_type to choose\n" in log, log
    assert f"model {tiny_model_dir.name} ready: qa, onnx fp32 on cpu" in log
    assert "CUDA" not in log
