"""The engine ``python server.py`` serves with where neither its flags nor a ``--config`` file
name one: on a GPU box PyTorch fp16 with CUDA graphs, the engine measured fastest there;
elsewhere the flags' defaults, ONNX Runtime fp32. It is chosen before the layout
(workers/layout.py), which then lays the GPU box out for it; both say why in the start-up log.

A GPU box here is one where PyTorch sees a CUDA device, whichever onnxruntime build is
installed. Every model served must have what PyTorch loads (config.json and model.safetensors,
which prepare_model.py writes, and a built-in task): one engine type serves them all, so a
single model without them keeps the whole server on ONNX Runtime, and the log names it. Where
prepare_model.py found a model's fp16 answers disagreeing with fp32's on the GPU (serving.json's
``torch_fp16``), the server runs fp32 there instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from engines import TORCH_GRAPH_AUTO
from engines.base import TASK_OUTPUT_NAMES
from engines.devices import torch_cuda_gpus
from engines.model_dir import ModelDirError, find_models, load_model_info
from settings.server_config import ServerConfig

#: The engine and precision a GPU box gets by default: the fastest measured there
#: (docs/benchmarks.md, "One H200": PyTorch fp16 with CUDA graphs runs a batch of 1 3.1-3.6x
#: faster than the traced graph). ONNX Runtime's CUDA path was last measured before GPU batching
#: was fixed and never beside PyTorch in one run; the GPU check (bench/gpu_check.sh) measures it
#: wherever onnxruntime has the CUDA provider. Where it measures faster, these follow.
GPU_ENGINE, GPU_PRECISION = "pytorch", "fp16"
#: The files of a model folder that PyTorch loads (prepare_model.py writes them).
TORCH_FILES = ("config.json", "model.safetensors")


class EngineChoice(NamedTuple):
    """The settings to serve with, and why, in words for the start-up log ("": nothing to say,
    a ``--broker`` front end, whose workers run the models)."""

    config: ServerConfig
    why: str


def choose_engine(config: ServerConfig, given: set[str], gpus: int | None = None,
                  models: Sequence[tuple[str, Path]] | None = None) -> EngineChoice:
    """The engine and precision for ``config`` where the settings in ``given`` (their names,
    a ``--config`` file's included) leave the engine open.

    Args:
        gpus: CUDA devices PyTorch sees (default: asked, ``torch_cuda_gpus``).
        models: (name, folder) of the models to serve (default: found in ``model_dir``).
    """
    if "inference_engine_type" in given:
        return EngineChoice(config, f"{describe(config)}, as the settings say")
    if config.broker is not None and config.role == "server":  # a front end runs no engine
        return EngineChoice(config, "")
    default = f"{describe(config)}, the default"
    if config.device == "cpu":
        return EngineChoice(config, f"{default} (--device cpu)")
    if not (torch_cuda_gpus() if gpus is None else gpus):
        return EngineChoice(config, f"{default} without a GPU; --inference_engine_type to choose")
    served = _served(config) if models is None else list(models)
    if lacking := torch_cannot_serve(served):
        return EngineChoice(config, f"{default}: {lacking}")
    precision, why = _precision(config, given, served)
    chosen = replace(config, inference_engine_type=GPU_ENGINE, precision=precision)
    return EngineChoice(chosen, f"{describe(chosen)}{why}")


def describe(config: ServerConfig) -> str:
    """The engine, precision and (PyTorch) graph, in words: ``pytorch fp16 with CUDA graphs``."""
    words = f"{config.inference_engine_type} {config.precision}"
    if config.inference_engine_type != "pytorch" or config.device == "cpu":
        return words
    graph = config.pytorch_graph
    return f"{words} with CUDA graphs" if graph in (TORCH_GRAPH_AUTO, "cudagraphs") else \
        f"{words}, {graph}"


def torch_cannot_serve(models: Sequence[tuple[str, Path]]) -> str:
    """Why PyTorch cannot serve every one of ``models``, in words ("" where it can)."""
    if not models:
        return "no prepared model found"
    for name, folder in models:
        if missing := [f for f in TORCH_FILES if not (folder / f).is_file()]:
            return f"model {name} has no {missing[0]} for PyTorch"
        try:
            task = load_model_info(folder).task
        except ModelDirError as exc:
            return f"model {name}: {exc}"
        if task not in TASK_OUTPUT_NAMES:
            return f"model {name} has plug-in task {task}, which PyTorch does not run"
    return ""


def _served(config: ServerConfig) -> list[tuple[str, Path]]:
    """The models of ``model_dir`` this process serves (a ``--role worker``: ``--models``)."""
    try:
        found = find_models(config.model_dir)
    except (ModelDirError, OSError):
        return []  # the start fails on it, and says why
    wanted = {m.strip() for m in config.models.split(",")} if config.models else None
    return [(name, folder) for name, folder in found if wanted is None or name in wanted]


def _precision(config: ServerConfig, given: set[str],
               models: Sequence[tuple[str, Path]]) -> tuple[str, str]:
    """PyTorch's precision on the GPU, and why in words: the settings', else fp16 unless
    prepare_model.py found a model's fp16 answers disagreeing with fp32's."""
    measured = ", measured fastest on a GPU (docs/gpu.md)"
    if "precision" in given:
        return config.precision, measured
    for name, folder in models:
        check = load_model_info(folder).torch_fp16 or {}
        if check.get("agrees") is False:
            return "fp32", f": fp16 disagreed with fp32 on model {name} (its serving.json)"
    return GPU_PRECISION, measured
