"""PyTorch engine: CUDA when present, else CPU; inference mode. It loads the folder's weights as
its task needs them (engines/task_models.py) and returns the outputs serving.json names. On
CUDA it runs the traced graph as CUDA graphs (engines/torch_cuda_graphs.py) and times each
batch on the device."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from engines import TORCH_GRAPH_AUTO, TORCH_GRAPHS
from engines.base import TASK_OUTPUT_NAMES, Engine, Launched, check_outputs
from engines.model_dir import ModelInfo, load_model_info
from engines.shapes import capture_lengths, graph_shapes, length_steps, row_steps
from engines.task_models import TaskOutputs, load_task_model
from engines.torch_cuda_graphs import Capture, CudaClock, ShapeGraphs, capture_checked
from engines.torch_graph import Forward, run_graph, trace_checked
from engines.torch_overlap import Launcher

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
        graph: "auto" (default): "cudagraphs" on CUDA, "traced" elsewhere. "traced": the model
            as one TorchScript graph, which runs without the GIL between operators
            (engines/torch_graph.py), checked against the eager model; where tracing fails or
            disagrees, it says why and runs eager. "cudagraphs": the traced graph captured as
            one CUDA graph per batch shape (engines/torch_cuda_graphs.py); where it cannot be,
            it says why in one line and runs the traced graph. "eager": operator by operator,
            as transformers runs it. ``graph`` (the attribute) says which runs.
        lengths: The lengths batches are padded to (the server's ``--length_buckets``), for
            CUDA graphs; empty: ``DEFAULT_LENGTHS``. The longest served length always closes
            them.
        max_seq_len: The longest length served (the server's ``--max_seq_len``); 0 or more
            than the model's: the model's.
        max_tokens: The token budget (rows x length): larger shapes are not captured (0: none).
        capture: How one shape is captured (engines/torch_cuda_graphs.Capture); None: a CUDA
            graph on CUDA, nothing elsewhere. ``TracedReplay`` stands in for it on the CPU.

    Raises:
        ValueError: The folder's task is not built in (a plug-in task runs on the onnx engine).
    """

    name = "pytorch"

    def __init__(self, model_dir: str | Path, *, device: str = "auto", threads: int = 0,
                 precision: str = "fp32", graph: str = TORCH_GRAPH_AUTO,
                 lengths: Sequence[int] = (), max_seq_len: int = 0, max_tokens: int = 0,
                 capture: Capture | None = None) -> None:
        if graph not in (TORCH_GRAPH_AUTO, *TORCH_GRAPHS):
            raise ValueError(f"unknown PyTorch graph {graph!r}; choose from "
                             f"{(TORCH_GRAPH_AUTO, *TORCH_GRAPHS)}")
        info = load_model_info(model_dir)
        self.torch_device = choose_device(device)
        self.device = str(self.torch_device)
        on_cuda = self.torch_device.type == "cuda"
        if graph == TORCH_GRAPH_AUTO:
            graph = "cudagraphs" if on_cuda else "traced"
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
        dtype = _DTYPES[self.precision]
        self.model = TaskOutputs(model, info.task, list(self.input_names)).eval().to(
            self.torch_device, dtype=dtype)
        #: On CUDA the GPU runs each batch apart from the host: fill batches (Engine).
        self.device_bound = on_cuda
        self._clock = CudaClock(self.torch_device) if on_cuda else None
        #: The captured shape (rows, length) the last batch replayed; None: no graph did.
        self.last_shape: tuple[int, int] | None = None
        self.graph: str = "eager"
        self._traced: Forward | None = None
        self._graphs: ShapeGraphs | None = None
        self._launcher: Launcher | None = None
        if graph != "eager":
            longest = min(max_seq_len or info.max_seq_len, info.max_seq_len)
            shapes = graph_shapes(capture_lengths(lengths, longest), max_tokens)
            self._build_graphs(info, dtype, shapes if graph == "cudagraphs" else None, capture)

    def _build_graphs(self, info: ModelInfo, dtype: torch.dtype,
                      shapes: list[tuple[int, int]] | None, capture: Capture | None) -> None:
        """Trace the model, then (``shapes`` given) capture the traced graph at ``shapes``;
        where a step fails, say why in one line and run what the steps before it gave."""
        self._traced, why = trace_checked(self.model, self.input_names, self._config,
                                          info.max_seq_len, self.torch_device, dtype)
        if self._traced is None:
            log.warning("PyTorch engine runs eager%s (%s): beside busy threads each of its "
                        "operators waits for the GIL",
                        "" if shapes is None else ", not CUDA graphs", why)
            return
        self.graph = "traced"
        if shapes is None:
            return
        self._graphs, why = capture_checked(self._traced, capture, shapes, self.input_names,
                                            self._config, self.torch_device, dtype,
                                            per_token=info.task == "qa")
        if self._graphs is None:
            log.warning("PyTorch engine runs the traced graph, not CUDA graphs: %s", why)
        else:
            self.graph = "cudagraphs"
            self.row_steps = row_steps(self._graphs.shapes)  # batches pad rows to these
            self.length_steps = length_steps(self._graphs.shapes)  # and lengths
            self._launcher = Launcher(self._graphs.replays, self.torch_device,
                                      self.output_names, self._graphs.per_token)
            self.overlaps = True  # an executor may copy the next batch in while one runs

    @torch.inference_mode()
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; see :meth:`Engine.run`. Sets ``device_s`` on CUDA, and
        ``last_shape``."""
        self.last_shape, self.device_s = None, None
        if self._traced is not None:
            outputs = self._run_traced(feeds)
        else:
            outputs = self._run_eager(feeds)
        check_outputs(feeds, outputs)
        return outputs

    def _stacked(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        """The inputs as one ``[inputs, rows, length]`` int64 array, in ``input_names`` order."""
        return np.stack([np.asarray(feeds[name], dtype=np.int64) for name in self.input_names])

    def launch(self, feeds: Mapping[str, np.ndarray]) -> Launched:
        """With CUDA graphs, start a batch without waiting for it (engines/torch_overlap.py);
        a batch no captured shape holds runs now."""
        stacked = self._stacked(feeds)
        launched = self._launcher.launch(stacked) if self._launcher is not None else None
        return launched if launched is not None else super().launch(feeds)

    def _run_traced(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inputs stacked into one array; the captured graph of the smallest shape that holds
        them where there is one, else the traced graph: one copy to the device, the graph, one
        copy back. Each tensor call waits for the GIL on its way back, beside busy threads."""
        assert self._traced is not None
        stacked = self._stacked(feeds)
        ran = self._graphs.run(stacked, self._clock) if self._graphs is not None else None
        if ran is not None:
            values, self.last_shape = ran
        elif self.torch_device.type == "cpu":
            values = run_graph(self._traced, torch.from_numpy(stacked)).numpy()
        else:
            on_device = torch.from_numpy(stacked).to(self.torch_device, non_blocking=True)
            self._clock_start()
            result = run_graph(self._traced, on_device)
            self._clock_stop()
            values = result.cpu().numpy()
        if self._clock is not None:
            self.device_s = self._clock.seconds()
        return dict(zip(self.output_names, values, strict=True))

    def _run_eager(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model operator by operator, as transformers runs it. On CUDA its device time
        spans the GIL waits between its operators' launches: an upper bound."""
        tensors = [torch.from_numpy(np.ascontiguousarray(feeds[name], dtype=np.int64)).to(
            self.torch_device, non_blocking=True) for name in self.input_names]
        self._clock_start()
        outputs = self.model(*tensors)
        self._clock_stop()
        values = {name: value.float().cpu().numpy()
                  for name, value in zip(self.output_names, outputs, strict=True)}
        if self._clock is not None:
            self.device_s = self._clock.seconds()
        return values

    def _clock_start(self) -> None:
        if self._clock is not None:
            self._clock.start()

    def _clock_stop(self) -> None:
        if self._clock is not None:
            self._clock.stop()

    def release_memory(self) -> None:
        """On CUDA, give back the caching allocator's blocks no tensor holds (CUDA graphs'
        pools stay theirs); on the CPU there is nothing of PyTorch's own to give back."""
        if self.torch_device.type == "cuda":
            torch.cuda.empty_cache()

    def memory_figures(self) -> dict[str, float]:
        """On CUDA, what PyTorch's caching allocator holds on the engine's GPU (``device_mb``:
        the whole process's on that GPU, every engine of it)."""
        if self.torch_device.type != "cuda":
            return {}
        return {"device_mb": round(torch.cuda.memory_reserved(self.torch_device) / 2**20, 1)}

    def describe(self) -> str:
        """Engine, device, dtype and graph, for logs."""
        attention = getattr(self._config, "_attn_implementation", None) or "eager"
        graph = self._graphs.describe() if self._graphs is not None else f"{self.graph} graph"
        return (f"pytorch {torch.__version__} on {self.device} ({self.precision}, {graph}, "
                f"{attention} attention, threads: {torch.get_num_threads()})")
