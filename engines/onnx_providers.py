"""Which ONNX Runtime execution providers a session asks for, and what it says about the result.

The order is TensorRT, CUDA, CPU: each one takes the parts of the graph it can run. TensorRT is
asked for only where its libraries load, and keeps its built engines in the model folder
(``trt_cache/``; under the user's cache folder where the model folder is read-only), so a
restart reuses them instead of building for minutes. ``open_session``
makes sure a session runs on the GPU it was given, or, for ``--device auto``, on the CPU when the
GPU cannot start (onnxruntime's own retry of a failing list forgets the GPU index).
``provider_report`` is the start-up log line: what was asked, what runs, and why each missing
provider is missing.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path

import onnxruntime as ort

log = logging.getLogger(__name__)

TENSORRT_PROVIDER = "TensorrtExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"
TRT_CACHE_DIR = "trt_cache"
TRT_LIBRARY = "libnvinfer.so.10"  # the TensorRT major version onnxruntime-gpu 1.31 links against

Provider = str | tuple[str, dict[str, object]]


def tensorrt_libraries() -> bool:
    """Whether TensorRT's runtime library loads in this process."""
    try:
        ctypes.CDLL(TRT_LIBRARY)
    except OSError:
        return False
    return True


def trt_cache_dir(model_dir: Path) -> Path | None:
    """Where TensorRT keeps its engines: the model folder's ``trt_cache/``, or, where that
    cannot be written (a read-only mount), a folder of this model's under the user's cache;
    None where neither can be (TensorRT then builds its engines at every start)."""
    wanted = Path(model_dir) / TRT_CACHE_DIR
    if _writable_folder(wanted):
        return wanted
    try:
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no home folder to be found
        home = None
    key = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]
    fallback = None if home is None else home / "qa-server" / TRT_CACHE_DIR / key
    if fallback is not None and _writable_folder(fallback):
        log.warning("%s cannot be written (a read-only mount?): TensorRT engines are cached in "
                    "%s instead", wanted, fallback)
        return fallback
    log.warning("no folder to cache TensorRT engines in (%s and the user's cache cannot be "
                "written): they are built at every start", wanted)
    return None


def _writable_folder(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def choose_providers(device: str, *, model_dir: Path | None = None, fp16: bool = False,
                     available: list[str] | None = None,
                     tensorrt: bool | None = None) -> list[Provider]:
    """Execution providers for ``device`` ("auto", "cpu", "cuda" or "cuda:N"), best first.

    Args:
        model_dir: Where TensorRT keeps its engine cache (``trt_cache/`` inside it).
        fp16: Let TensorRT build float16 engines.
        available: The providers this onnxruntime build has (default: ask it).
        tensorrt: Whether TensorRT's libraries load (default: try to load them).

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
    if TENSORRT_PROVIDER in available and (tensorrt_libraries() if tensorrt is None else tensorrt):
        cache = trt_cache_dir(model_dir) if model_dir is not None else None
        options: dict[str, object] = {"device_id": index, "trt_fp16_enable": fp16,
                                      "trt_engine_cache_enable": model_dir is None or bool(cache),
                                      "trt_timing_cache_enable": model_dir is None or bool(cache)}
        if cache is not None:
            options["trt_engine_cache_path"] = str(cache)
        chain.append((TENSORRT_PROVIDER, options))
    return chain + [(CUDA_PROVIDER, {"device_id": index}), CPU_PROVIDER]


def open_session(path: Path, options: ort.SessionOptions, asked: list[Provider],
                 device: str) -> tuple[ort.InferenceSession, list[Provider]]:
    """A session on ``asked``, and the providers finally asked for.

    Raises:
        RuntimeError: The GPU named by ``device`` (not "auto") cannot start.
    """
    try:
        session = ort.InferenceSession(str(path), options, providers=asked)
    except (RuntimeError, ValueError) as exc:
        if device != "auto" or asked == [CPU_PROVIDER]:
            raise RuntimeError(f"onnxruntime cannot start on {device}: {exc}") from exc
        log.warning("onnxruntime cannot start on the GPU (%s); running on the CPU",
                    str(exc).splitlines()[0][:300])
        return ort.InferenceSession(str(path), options, providers=[CPU_PROVIDER]), [CPU_PROVIDER]
    wanted = next((p[1]["device_id"] for p in asked if not isinstance(p, str)
                   and p[0] == CUDA_PROVIDER), None)
    got = session.get_provider_options().get(CUDA_PROVIDER, {}).get("device_id")
    if wanted is not None and got is not None and int(got) != int(wanted):  # type: ignore[arg-type]
        asked = without_tensorrt(asked)  # TensorRT failed
        session = ort.InferenceSession(str(path), options, providers=asked)
    return session, asked


def without_tensorrt(providers: list[Provider]) -> list[Provider]:
    """``providers`` less TensorRT."""
    return [p for p in providers if names([p]) != [TENSORRT_PROVIDER]]


def names(providers: list[Provider]) -> list[str]:
    """The providers' names, without their options."""
    return [p if isinstance(p, str) else p[0] for p in providers]


def provider_report(asked: list[Provider], active: list[str], available: list[str]) -> str:
    """One line: the providers asked for, those running, and why each of the others is not."""
    asked_names = names(asked)
    reasons = []
    for wanted in (TENSORRT_PROVIDER, CUDA_PROVIDER):
        if wanted in active:
            continue
        if wanted not in available:
            why = "not in this onnxruntime build"
        elif CPU_PROVIDER in asked_names and len(asked_names) == 1:
            why = "not asked for (--device cpu, or the GPU could not start)"
        elif wanted not in asked_names:
            why = f"its libraries ({TRT_LIBRARY}) do not load"
        else:
            why = "could not start (onnxruntime logged why above: missing or mismatched libraries?)"
        reasons.append(f"{_short(wanted)}: {why}")
    return (f"execution providers: asked {' -> '.join(map(_short, asked_names))}; running "
            f"{' -> '.join(map(_short, active))}" + (f" ({'; '.join(reasons)})" if reasons else ""))


def provider_note(asked: list[Provider], active: list[str]) -> str:
    """Which GPU provider asked for is not running, in words; empty where each one asked for
    runs (a CPU-only run asks for none, so a machine without a GPU hears nothing of them)."""
    missing = [_short(p) for p in names(asked) if p != CPU_PROVIDER and p not in active]
    if not missing:
        return ""
    return (f"{' and '.join(missing)} asked for but not running (running "
            f"{' -> '.join(map(_short, active))}; --log_level DEBUG says why)")


def _short(provider: str) -> str:
    return provider.removesuffix("ExecutionProvider").replace("Tensorrt", "TensorRT")
