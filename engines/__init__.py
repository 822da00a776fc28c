"""Inference engines (numpy in, numpy out) and the QA task around them."""

from __future__ import annotations

from pathlib import Path

from engines.base import Engine

ENGINE_TYPES = ("onnx", "pytorch")


def load_engine(kind: str, model_dir: str | Path, *, device: str = "auto", threads: int = 0) -> Engine:
    """Load one engine of ``kind`` ("onnx" or "pytorch") from a prepared model folder.

    The backend is imported only here, so a server using ONNX never imports torch's CUDA stack.
    """
    if kind == "onnx":
        from engines.onnx_engine import OnnxEngine

        return OnnxEngine(model_dir, device=device, intra_op_threads=threads)
    if kind == "pytorch":
        from engines.torch_engine import TorchEngine

        return TorchEngine(model_dir, device=device, threads=threads)
    raise ValueError(f"unknown engine type {kind!r}; choose from {ENGINE_TYPES}")
