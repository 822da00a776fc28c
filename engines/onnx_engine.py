"""ONNX Runtime engine: TensorRT, then CUDA, where present, else the CPU (onnx_providers.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from engines.base import Engine, check_outputs
from engines.model_dir import ModelInfo, load_model_info
from engines.onnx_binding import BoundRunner, GraphRunner, graph_options
from engines.onnx_providers import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    TENSORRT_PROVIDER,
    Provider,
    choose_providers,
    names,
    open_session,
    provider_note,
    provider_report,
    without_tensorrt,
)
from engines.shapes import capture_lengths, graph_shapes, length_steps, row_steps

log = logging.getLogger(__name__)


class OnnxEngine(Engine):
    """Runs ``model.onnx`` from a prepared model folder with one ``InferenceSession``.

    Args:
        model_dir: Folder written by prepare_model.py.
        device: "auto" (CUDA if available, else CPU), "cpu", "cuda" or "cuda:N".
        intra_op_threads: Threads of one batch's operators; 0 lets ONNX Runtime choose (all
            cores). On the CPU every session of the model shares this engine (``shareable``):
            batches run side by side on it, each on its own ``intra_op_threads``.
        inter_op_threads: Threads across independent operators.
        lone_threads: On the CPU, more threads than ``intra_op_threads`` for a batch that has
            the machine to itself: a second ONNX Runtime session with that many threads runs a
            batch whenever ``crowded()`` is false, so a lone request gets every core while a
            loaded server keeps its cores shared out. The weights are held twice (once per
            session, shared by every session thread of the model). Its threads spin between
            operators while a batch runs (a sleeping thread's wake-up at every operator cost
            about 1.5 ms of MiniLM's 18) and stop the moment the batch ends, so they burn
            nothing between requests (docs/benchmarks.md).
        crowded: Whether other work competes for the cores now (other sessions running, or
            requests waiting); default: always, i.e. never the lone session.
        precision: "fp16" runs the folder's ``model_fp16.onnx`` (prepare_model.py --fp16);
            without one, and for "bf16" (no such export), it says so and runs fp32.
        io_binding: Run batches through ``BoundRunner`` (device buffers kept per shape); None:
            where the session runs on CUDA.
        cuda_graphs: On the CUDA provider, replay the model as CUDA graphs, one per batch shape
            (``GraphRunner``; the shapes of engines/shapes.py at ``lengths`` under the longest
            of ``max_seq_len`` and the model's, within ``max_tokens``); a batch no shape holds
            runs as before. Where they cannot be captured it says why in one line and runs
            without them. Off by default: not yet measured faster on a GPU (docs/gpu.md).
    """

    name = "onnx"

    def __init__(self, model_dir: str | Path, *, device: str = "auto", intra_op_threads: int = 0,
                 inter_op_threads: int = 1, lone_threads: int = 0,
                 crowded: Callable[[], bool] | None = None, precision: str = "fp32",
                 io_binding: bool | None = None, cuda_graphs: bool = False,
                 lengths: Sequence[int] = (), max_seq_len: int = 0, max_tokens: int = 0) -> None:
        path, asked = self._open(Path(model_dir), device, precision,
                                 _options(intra_op_threads, inter_op_threads))
        log.debug("%s", provider_report(asked, self.session.get_providers(),
                                        ort.get_available_providers()))
        if note := provider_note(asked, self.session.get_providers()):
            log.warning("onnx engine: %s", note)
        active = CUDA_PROVIDER if CUDA_PROVIDER in self.session.get_providers() else CPU_PROVIDER
        self.lone_session: ort.InferenceSession | None = None
        if active == CPU_PROVIDER and lone_threads > intra_op_threads > 0 and crowded is not None:
            self.lone_session = ort.InferenceSession(
                str(path), _options(lone_threads, inter_op_threads), providers=[CPU_PROVIDER])
        self.crowded = crowded or (lambda: True)
        self.lone_threads = lone_threads if self.lone_session is not None else 0
        self.lone_runs = 0  # batches run with every core
        self.device = "cuda:" + str(self._cuda_index()) if active == CUDA_PROVIDER else "cpu"
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.threads = intra_op_threads
        self.binder: BoundRunner | None = None
        if active == CUDA_PROVIDER if io_binding is None else io_binding:
            where = ("cuda", self._cuda_index()) if active == CUDA_PROVIDER else ("cpu", 0)
            self.binder = BoundRunner(self.session, self.output_names, *where)
        #: On CUDA the GPU runs each batch apart from the host: fill batches (Engine).
        self.device_bound = active == CUDA_PROVIDER
        self._shrink = _shrink_options(active, self._cuda_index())
        self.graphs: GraphRunner | None = None
        if cuda_graphs:
            info = load_model_info(model_dir)
            longest = min(max_seq_len or info.max_seq_len, info.max_seq_len)
            shapes = graph_shapes(capture_lengths(lengths, longest), max_tokens)
            if why := self._open_graphs(path, shapes, intra_op_threads, inter_op_threads):
                log.warning("ONNX engine runs without CUDA graphs: %s", why)
        #: ``InferenceSession.run`` is thread-safe; device buffers kept per shape are not.
        self.shareable = self.binder is None and self.graphs is None

    def _open_graphs(self, path: Path, shapes: list[tuple[int, int]], intra_op_threads: int,
                     inter_op_threads: int) -> str:
        """Reopen the session with CUDA graphs and capture ``shapes``; why not, in words, where
        it cannot (the session is left as it was)."""
        providers = self.session.get_providers()
        if CUDA_PROVIDER not in providers:
            return f"they need the CUDA provider (the engine runs on {self.device})"
        if TENSORRT_PROVIDER in providers:
            return "TensorRT runs the model, and builds engines of its own"
        if "attention_mask" not in self.input_names:
            return "the model takes no attention_mask, so padding would change its outputs"
        index = self._cuda_index()
        graphed = [(CUDA_PROVIDER, {"device_id": index, "enable_cuda_graph": "1"}),
                   CPU_PROVIDER]
        try:
            session = ort.InferenceSession(str(path), _options(intra_op_threads,
                                                               inter_op_threads),
                                           providers=graphed)
            runner = GraphRunner(session, shapes, "cuda", index)
            runner.capture()
        except Exception as exc:  # noqa: BLE001 - any failure leaves the plain session, said why
            words = (str(exc).strip().splitlines() or [""])[0][:300]
            return f"capture failed: {type(exc).__name__}: {words}"
        self.session, self.graphs = session, runner
        self.row_steps = row_steps(runner.shapes)  # batches pad rows to these
        self.length_steps = length_steps(runner.shapes)  # and lengths
        self.binder = BoundRunner(session, self.output_names, "cuda", index,
                                  run_options=graph_options(-1))  # batches no graph holds
        return ""

    def _open(self, folder: Path, device: str, precision: str,
              options: ort.SessionOptions) -> tuple[Path, list[Provider]]:
        """Open ``self.session`` and set ``self.precision``; the model file and providers used.

        TensorRT cannot parse the fp16 export's onnxruntime-only fused operators: it takes the
        plain graph and builds float16 engines itself. Where it then does not start, CUDA runs
        the fp16 export instead, as without TensorRT.
        """
        info = load_model_info(folder)
        asked = choose_providers(device, model_dir=folder, fp16=precision == "fp16")
        tensorrt = names(asked)[0] == TENSORRT_PROVIDER
        if tensorrt and precision == "fp16":
            self.precision, model_file = "fp16", info.onnx_file
        else:
            self.precision, model_file = model_file_for(info, folder, precision)
        self.session, asked = open_session(folder / model_file, options, asked, device)
        if tensorrt and TENSORRT_PROVIDER not in self.session.get_providers() \
                and precision == "fp16":
            self.precision, model_file = model_file_for(info, folder, precision)
            asked = without_tensorrt(asked)
            self.session, asked = open_session(folder / model_file, options, asked, device)
        return folder / model_file, asked

    def _cuda_index(self) -> int:
        options = self.session.get_provider_options().get(CUDA_PROVIDER, {})
        return int(options.get("device_id", 0))

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; see :meth:`Engine.run`."""
        inputs = {name: np.ascontiguousarray(feeds[name], dtype=np.int64) for name in self.input_names}
        session = self.session
        if self.lone_session is not None and not self.crowded():
            session = self.lone_session
            self.lone_runs += 1
        values = None
        if self.graphs is not None:
            values = self.graphs.run(inputs)  # None: no captured shape holds the batch
        if values is None and self.binder is not None:
            values = self.binder.run(inputs)
        elif values is None:
            values = session.run(list(self.output_names), inputs)
        outputs = dict(zip(self.output_names, values))
        check_outputs(inputs, outputs)
        return outputs

    def release_memory(self) -> None:
        """Shrink ONNX Runtime's memory arena to its first chunk: one smallest run whose run
        options free every arena region no batch holds now (batches running beside it keep
        theirs). The arena otherwise keeps what its largest batch took (1.2 GB for a 32 x
        384 MiniLM batch on the CPU, against the weights' 90 MB)."""
        if self.graphs is not None:
            return  # CUDA graphs replay fixed buffers: nothing of theirs is freed
        feeds = {name: np.zeros((1, 2), dtype=np.int64) for name in self.input_names}
        if "attention_mask" in feeds:
            feeds["attention_mask"][:] = 1
        for session in (self.session, self.lone_session):
            if session is not None:
                session.run(list(self.output_names), feeds, self._shrink)

    def describe(self) -> str:
        """Engine, device and thread settings, for logs."""
        threads = self.threads or "auto"
        more = f"; {self.lone_threads} for a lone batch" if self.lone_threads else ""
        more += "; I/O binding" if self.binder is not None else ""
        more += f"; CUDA graphs for {len(self.graphs.shapes)} shapes" if self.graphs else ""
        return (f"onnxruntime {ort.__version__} on {self.device} ({self.precision}, intra-op "
                f"threads: {threads}{more})")


def model_file_for(info: ModelInfo, folder: Path, precision: str) -> tuple[str, str]:
    """The precision the ONNX engine will run and the model file for it: fp16 where the folder
    has a checked fp16 export, else fp32 (logged, with what to do about it)."""
    if precision == "fp16":
        fp16 = info.fp16 or {}
        if fp16.get("file") and (folder / fp16["file"]).is_file():
            return "fp16", fp16["file"]
        log.warning("--precision fp16: %s has no fp16 model (prepare_model.py --fp16 writes "
                    "one); running fp32", folder)
    elif precision == "bf16":
        log.warning("--precision bf16: the ONNX engine has no bf16 model (the pytorch engine "
                    "runs bf16); running fp32")
    elif precision != "fp32":
        raise ValueError(f"unknown precision {precision!r}")
    return "fp32", info.onnx_file


def _options(intra_op_threads: int, inter_op_threads: int) -> ort.SessionOptions:
    """Session options: the thread counts, every graph optimisation, quiet logs; with more than
    one intra-op thread, threads that spin between operators and stop as a run ends."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if intra_op_threads != 1:
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def _shrink_options(provider: str, cuda_index: int) -> ort.RunOptions:
    """Run options that shrink the arena of the device the session runs on after the run."""
    options = ort.RunOptions()
    arena = f"gpu:{cuda_index}" if provider == CUDA_PROVIDER else "cpu:0"
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", arena)
    return options
