"""GPU figures through NVML (nvidia-ml-py): utilisation, memory and power sampled on a thread
while a load runs, and the names of the GPUs. Without a driver or a GPU every figure is absent,
not an error. Used by bench/gpu.py and bench/gpu_check.py."""

from __future__ import annotations

import threading
from typing import Any


def _nvml() -> tuple[Any, list[Any]]:
    """The initialised pynvml module and every GPU's handle; (None, []) without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no library, no driver or no GPU: nothing to read
        return None, []


def gpu_names() -> list[str]:
    """The name of every GPU NVML sees (none without a driver)."""
    nvml, handles = _nvml()
    names = [nvml.nvmlDeviceGetName(h) for h in handles]
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


class NvmlSampler:
    """Samples every GPU's utilisation, memory and power on a thread while a level runs.

        with sampler:
            run_the_load()
        sampler.summary()  # {"gpu_util_pct", "gpu_memory_mib", "gpu_power_w"}, or {}
    """

    def __init__(self, period_s: float = 0.2) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float, float]] = []  # (util %, memory MiB, watts) summed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml, self._handles = _nvml()

    @property
    def gpus(self) -> int:
        """GPUs NVML sees (0 without a driver)."""
        return len(self._handles)

    def __enter__(self) -> NvmlSampler:
        self.samples, self._stop = [], threading.Event()
        if self._handles:
            self._thread = threading.Thread(target=self._run, daemon=True, name="nvml")
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        nvml = self._nvml
        while not self._stop.wait(self.period_s):
            util = [nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            memory = sum(nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles) / 2**20
            watts = sum(nvml.nvmlDeviceGetPowerUsage(h) for h in self._handles) / 1000
            self.samples.append((sum(util) / len(util), memory, watts))

    def summary(self) -> dict[str, float]:
        """Mean utilisation (%, averaged over GPUs), peak memory (MiB) and mean power (W)."""
        if not self.samples:
            return {}
        util, memory, watts = zip(*self.samples, strict=True)
        return {"gpu_util_pct": sum(util) / len(util), "gpu_memory_mib": max(memory),
                "gpu_power_w": sum(watts) / len(watts)}
