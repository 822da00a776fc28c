"""Which ONNX Runtime execution providers a session asks for, and what it says about the result.

The order is TensorRT, CUDA, CPU: each one takes the parts of the graph it can run, and a provider
that cannot start (TensorRT without its libraries, say) leaves its work to the next. TensorRT keeps
its built engines in the model folder (``trt_cache/``), so a restart reuses them instead of
building for minutes. ``provider_report`` is the start-up log line: what was asked, what runs, and
why each missing provider is missing.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

TENSORRT_PROVIDER = "TensorrtExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"
TRT_CACHE_DIR = "trt_cache"

Provider = str | tuple[str, dict[str, object]]


def choose_providers(device: str, *, model_dir: Path | None = None, fp16: bool = False,
                     available: list[str] | None = None) -> list[Provider]:
    """Execution providers for ``device`` ("auto", "cpu", "cuda" or "cuda:N"), best first.

    Args:
        model_dir: Where TensorRT keeps its engine cache (``trt_cache/`` inside it).
        fp16: Let TensorRT build float16 engines.
        available: The providers this onnxruntime build has (default: ask it).

    Raises:
        RuntimeError: CUDA was asked for explicitly but this onnxruntime build has no CUDA
            provider.
    """
    available = ort.get_available_providers() if available is None else available
    if device == "cpu":
        return [CPU_PROVIDER]
    if CUDA_PROVIDER not in available:
        if device != "auto":
            raise RuntimeError(f"device {device!r} asked for, but this onnxruntime build offers "
                               f"only {available} (install onnxruntime-gpu for CUDA)")
        return [CPU_PROVIDER]
    index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
    chain: list[Provider] = []
    if TENSORRT_PROVIDER in available:
        options: dict[str, object] = {"device_id": index, "trt_fp16_enable": fp16,
                                      "trt_engine_cache_enable": True,
                                      "trt_timing_cache_enable": True}
        if model_dir is not None:
            options["trt_engine_cache_path"] = str(model_dir / TRT_CACHE_DIR)
        chain.append((TENSORRT_PROVIDER, options))
    return chain + [(CUDA_PROVIDER, {"device_id": index}), CPU_PROVIDER]


def provider_report(asked: list[Provider], active: list[str], available: list[str]) -> str:
    """One line: the providers asked for, those running, and why each of the others is not."""
    names = [p if isinstance(p, str) else p[0] for p in asked]
    reasons = []
    for wanted in (TENSORRT_PROVIDER, CUDA_PROVIDER):
        if wanted in active:
            continue
        if wanted not in available:
            why = "not in this onnxruntime build"
        elif wanted not in names:
            why = "not asked for (--device cpu)"
        else:
            why = "could not start (onnxruntime logged why above: missing or mismatched libraries?)"
        reasons.append(f"{_short(wanted)}: {why}")
    return (f"execution providers: asked {' -> '.join(map(_short, names))}; running "
            f"{' -> '.join(map(_short, active))}" + (f" ({'; '.join(reasons)})" if reasons else ""))


def _short(provider: str) -> str:
    return provider.removesuffix("ExecutionProvider").replace("Tensorrt", "TensorRT")
