"""Which GPUs an engine type can use here: checked before any worker starts, so that
``--cuda_devices`` on a machine without them fails at once with a clear message."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

#: Simulated GPUs the sim engine offers (``--cuda_devices`` 0 to 15).
SIM_DEVICES = 16


class DeviceError(RuntimeError):
    """The GPUs asked for are not usable by this engine type on this machine."""


def visible_gpus() -> int:
    """NVIDIA GPUs the driver shows (NVML; 0 without a driver), before CUDA_VISIBLE_DEVICES."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: none
        return 0


def usable_gpus(engine_type: str) -> tuple[int, str]:
    """How many GPUs ``engine_type`` can use here, and why none when that is 0 (the sim
    engine: SIM_DEVICES simulated ones, on any machine)."""
    if engine_type == "sim":
        return SIM_DEVICES, ""
    if engine_type == "pytorch":
        import torch

        count = torch.cuda.device_count()
        return count, "" if count else f"torch {torch.__version__} sees no CUDA device"
    if engine_type == "onnx":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return 0, (f"this onnxruntime ({ort.__version__}) has no CUDA provider (the GPU "
                       "build is onnxruntime-gpu: docker/requirements-gpu.txt)")
    count = visible_gpus()
    return count, "" if count else "no NVIDIA GPU or driver is visible (NVML)"


def torch_cuda_gpus() -> int:
    """CUDA devices PyTorch sees, whichever onnxruntime build is installed; 0 without torch.
    Where NVML shows no GPU, 0 without importing torch (its import costs seconds and 200 MB)."""
    if importlib.util.find_spec("pynvml") is not None and visible_gpus() == 0:
        return 0
    try:
        return usable_gpus("pytorch")[0]
    except ImportError:
        return 0


def check_cuda_devices(engine_type: str, indices: Sequence[int]) -> None:
    """Raise unless every GPU index in ``indices`` is usable by ``engine_type``.

    Raises:
        DeviceError: no GPU at all, or an index beyond the GPUs there are, said in words.
    """
    if not indices:
        return
    wanted = ",".join(map(str, indices))
    count, why = usable_gpus(engine_type)
    if count == 0:
        raise DeviceError(f"--cuda_devices {wanted} asks for GPUs, but {why}; leave "
                          "--cuda_devices out to serve on the CPU (--workers works there too)")
    beyond = [i for i in indices if i >= count]
    if beyond:
        raise DeviceError(f"--cuda_devices {wanted}: GPU {beyond[0]} does not exist; this machine "
                          f"has {count} (0 to {count - 1})")
