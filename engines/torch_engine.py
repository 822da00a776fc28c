"""PyTorch engine: CUDA when present, else CPU; inference mode. It loads the folder's weights as
its task needs them (engines/task_models.py) and returns the outputs serving.json names."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from engines import TORCH_GRAPHS
from engines.base import TASK_OUTPUT_NAMES, Engine, check_outputs
from engines.model_dir import load_model_info
from engines.task_models import TaskOutputs, load_task_model
from engines.torch_graph import Forward, run_graph, trace_checked

# transformers' from_pretrained is not safe to run in several threads at once (it builds the model
# on the "meta" device and materialises it; concurrent loads fail with "Cannot copy out of meta
# tensor"). Sessions load their engines in parallel, so PyTorch loads take turns.
_LOAD_LOCK = threading.Lock()
log = logging.getLogger(__name__)


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_precision(precision: str, device: torch.device) -> str:
    """``precision`` where ``device`` runs it, else "fp32" (logged)."""
    if precision not in _DTYPES:
        raise ValueError(f"unknown precision {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        log.warning("--precision fp16: PyTorch runs float16 only on CUDA, not on %s; running "
                    "fp32", device)
        return "fp32"
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        log.warning("--precision bf16: %s has no bfloat16; running fp32", device)
        return "fp32"
    return precision


def choose_device(device: str) -> torch.device:
    """A torch device for "auto", "cpu", "cuda" or "cuda:N".

    Raises:
        RuntimeError: CUDA was asked for explicitly but is not available.
    """
    if device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda:0" if device in ("auto", "cuda") else device)
    if device != "auto":
        raise RuntimeError(f"device {device!r} asked for, but torch sees no CUDA device")
    return torch.device("cpu")


class TorchEngine(Engine):
    """Runs the PyTorch weights of a prepared model folder.

    Args:
        model_dir: Folder written by prepare_model.py.
        device: "auto" (CUDA if available, else CPU), "cpu", "cuda" or "cuda:N".
        threads: CPU threads for torch (process-wide setting); 0 leaves torch's default.
        precision: "fp32", "fp16" (CUDA only) or "bf16" (CPU, and GPUs that have it); where
            the device cannot, it says so and runs fp32. Outputs come back as float32.
        graph: "traced" (default): the model as one TorchScript graph, which runs without the
            GIL between operators (engines/torch_graph.py), checked against the eager model;
            where tracing fails or disagrees, it says why and runs eager. "eager": operator by
            operator, as transformers runs it. ``graph`` (the attribute) says which runs.

    Raises:
        ValueError: The folder's task is not built in (a plug-in task runs on the onnx engine).
    """

    name = "pytorch"

    def __init__(self, model_dir: str | Path, *, device: str = "auto", threads: int = 0,
                 precision: str = "fp32", graph: str = "traced") -> None:
        if graph not in TORCH_GRAPHS:
            raise ValueError(f"unknown PyTorch graph {graph!r}; choose from {TORCH_GRAPHS}")
        info = load_model_info(model_dir)
        self.torch_device = choose_device(device)
        self.device = str(self.torch_device)
        if threads > 0:
            torch.set_num_threads(threads)
        with _LOAD_LOCK:
            model = load_task_model(info.task, model_dir)
        self.precision = torch_precision(precision, self.torch_device)
        self.input_names = tuple(info.input_names)
        self.output_names = TASK_OUTPUT_NAMES[info.task]  # the order TaskOutputs returns
        if set(info.output_names) != set(self.output_names):  # serving.json's order may differ
            raise ValueError(f"serving.json names outputs {info.output_names}; a {info.task} "
                             f"model gives {list(self.output_names)}")
        self._config = model.config
        self.model = TaskOutputs(model, info.task, list(self.input_names)).eval().to(
            self.torch_device, dtype=_DTYPES[self.precision])
        self.graph: str = "eager"
        self._traced: Forward | None = None
        if graph == "traced":
            self._traced, why = trace_checked(self.model, self.input_names, model.config,
                                              info.max_seq_len, self.torch_device,
                                              _DTYPES[self.precision])
            if self._traced is None:
                log.warning("PyTorch engine runs eager (%s): beside busy threads each of its "
                            "operators waits for the GIL", why)
            else:
                self.graph = "traced"

    @torch.inference_mode()
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; see :meth:`Engine.run`."""
        if self._traced is not None:
            outputs = self._run_traced(feeds)
        else:
            outputs = self._run_eager(feeds)
        check_outputs(feeds, outputs)
        return outputs

    def _run_traced(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inputs stacked into one tensor, one copy to the device, the graph, one copy back:
        each tensor call waits for the GIL on its way back, beside busy threads."""
        assert self._traced is not None
        stacked = torch.from_numpy(np.stack([np.asarray(feeds[name], dtype=np.int64)
                                             for name in self.input_names]))
        on_cpu = self.torch_device.type == "cpu"
        result = run_graph(self._traced, stacked if on_cpu else
                           stacked.to(self.torch_device, non_blocking=True))
        values = (result if on_cpu else result.cpu()).numpy()
        return dict(zip(self.output_names, values, strict=True))

    def _run_eager(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model operator by operator, as transformers runs it."""
        tensors = [torch.from_numpy(np.ascontiguousarray(feeds[name], dtype=np.int64)).to(
            self.torch_device, non_blocking=True) for name in self.input_names]
        return {name: value.float().cpu().numpy()
                for name, value in zip(self.output_names, self.model(*tensors), strict=True)}

    def describe(self) -> str:
        """Engine, device, dtype and graph, for logs."""
        attention = getattr(self._config, "_attn_implementation", None) or "eager"
        return (f"pytorch {torch.__version__} on {self.device} ({self.precision}, {self.graph} "
                f"graph, {attention} attention, threads: {torch.get_num_threads()})")
