"""ONNX Runtime I/O binding: a batch's inputs copied once into device buffers kept per shape;
and, on CUDA, the session replayed as CUDA graphs, one per captured shape (``GraphRunner``).

With ``session.run`` and numpy inputs, ONNX Runtime allocates device buffers, copies the inputs
in and the outputs back, for every batch. ``BoundRunner`` keeps one set of device input buffers
per batch shape (few shapes with ``--length_buckets``), writes a batch into them with one copy per
input, binds the two logit outputs to host memory, and runs. It works on any ONNX Runtime device;
the server uses it where the engine runs on CUDA, and the tests run it on the CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from engines.shapes import pad_into, pick_shape

#: Batch shapes whose device buffers are kept (least recently used dropped first).
KEPT_SHAPES = 16


class BoundRunner:
    """Runs one session with its inputs in device buffers kept per shape.

    Args:
        session: The ONNX Runtime session (one thread uses it at a time, as the engine does).
        device: ``"cuda"`` or ``"cpu"``: where the input buffers live.
        device_id: The GPU index for ``"cuda"``.
    """

    def __init__(self, session: ort.InferenceSession, output_names: Sequence[str],
                 device: str = "cuda", device_id: int = 0,
                 run_options: ort.RunOptions | None = None) -> None:
        self.session = session
        self.output_names = tuple(output_names)
        self.device, self.device_id = device, device_id
        self.run_options = run_options  # a CUDA-graph session's: no capture for these runs
        self._buffers: OrderedDict[tuple[int, ...], dict[str, ort.OrtValue]] = OrderedDict()
        self.allocations = 0  # buffer sets made, for tests and stats

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs for ``inputs`` (int64, C-contiguous, all of one shape), in the order of
        ``output_names``."""
        buffers = self._buffers_for(next(iter(inputs.values())).shape, inputs)
        binding = self.session.io_binding()
        for name, value in inputs.items():
            buffers[name].update_inplace(value)  # the one host-to-device copy of this input
            binding.bind_ortvalue_input(name, buffers[name])
        for name in self.output_names:
            binding.bind_output(name, "cpu")  # only the logits come back
        self.session.run_with_iobinding(binding, self.run_options)
        return binding.copy_outputs_to_cpu()

    def _buffers_for(self, shape: tuple[int, ...],
                     inputs: Mapping[str, np.ndarray]) -> dict[str, ort.OrtValue]:
        if shape in self._buffers:
            self._buffers.move_to_end(shape)
            return self._buffers[shape]
        # a copy: on the CPU an OrtValue wraps the array it is given, which is the caller's
        made = {name: ort.OrtValue.ortvalue_from_numpy(value.copy(), self.device, self.device_id)
                for name, value in inputs.items()}
        self.allocations += 1
        self._buffers[shape] = made
        if len(self._buffers) > KEPT_SHAPES:
            self._buffers.popitem(last=False)
        return made


#: The run option that names the CUDA graph a run captures or replays (onnxruntime's
#: ``gpu_graph_id``: 1, 2, ... one per shape; -1 runs without a graph).
GRAPH_ID = "gpu_graph_id"


def graph_options(graph_id: int) -> ort.RunOptions:
    """Run options that capture or replay graph ``graph_id`` (-1: no graph)."""
    options = ort.RunOptions()
    options.add_run_config_entry(GRAPH_ID, str(graph_id))
    return options


@dataclass
class _Graph:
    """One captured shape: its run options, device buffers and the host side of its inputs."""

    options: ort.RunOptions
    inputs: dict[str, ort.OrtValue]
    outputs: dict[str, ort.OrtValue]
    host: np.ndarray  # [inputs, rows, length] int64


class GraphRunner:
    """Runs a session opened with the CUDA provider's ``enable_cuda_graph`` as one CUDA graph
    per captured shape (engines/shapes.py): a graph replays on the device addresses it was
    captured with, so each shape keeps its input and output buffers for the session's life. A
    batch is padded into its shape, run, and its outputs cut back to its rows (and length, for
    per-token outputs). It runs on the CPU too (onnxruntime ignores the graph ids there), which
    is how the tests check it.

    Args:
        session: The session; one thread runs it at a time.
        shapes: The (rows, length) shapes to capture.
        device, device_id: Where the buffers live (``"cuda"``, or ``"cpu"`` in tests).
    """

    def __init__(self, session: ort.InferenceSession, shapes: Sequence[tuple[int, int]],
                 device: str = "cuda", device_id: int = 0) -> None:
        self.session = session
        self.input_names = tuple(i.name for i in session.get_inputs())
        self.output_names = tuple(o.name for o in session.get_outputs())
        self.device, self.device_id = device, device_id
        self.shapes = sorted(shapes)
        # per-token outputs ([rows, sequence], QA logits) are cut back to the batch's length too
        self._per_token = {o.name: len(o.shape) > 1 and not isinstance(o.shape[1], int)
                           for o in session.get_outputs()}
        self._graphs = {shape: self._buffers(shape, number + 1)
                        for number, shape in enumerate(self.shapes)}

    def _buffers(self, shape: tuple[int, int], graph_id: int) -> _Graph:
        rows, length = shape
        host = np.zeros((len(self.input_names), rows, length), dtype=np.int64)
        host[self.input_names.index("attention_mask")] = 1  # no row all padding at capture
        inputs = {name: ort.OrtValue.ortvalue_from_numpy(host[i].copy(), self.device,
                                                         self.device_id)
                  for i, name in enumerate(self.input_names)}
        outputs = {o.name: ort.OrtValue.ortvalue_from_shape_and_type(
            _output_shape(o.shape, rows, length), np.float32, self.device, self.device_id)
            for o in self.session.get_outputs()}
        return _Graph(graph_options(graph_id), inputs, outputs, host)

    def capture(self) -> None:
        """Run every shape twice (onnxruntime captures a graph on one of its first runs), then
        check each replay on other inputs against a run without graphs.

        Raises:
            RuntimeError: a replay disagrees (or what onnxruntime raised).
        """
        for graph in self._graphs.values():
            for _ in range(2):
                self._replay(graph)
        plain = graph_options(-1)
        for rows, length in self._graphs:
            sample = np.arange(rows * length, dtype=np.int64).reshape(rows, length) % 97 + 1
            feeds = {name: (np.ones_like(sample) if name == "attention_mask" else
                            np.zeros_like(sample) if name == "token_type_ids" else sample)
                     for name in self.input_names}
            got = self.run(feeds)
            want = self.session.run(list(self.output_names), feeds, plain)
            for name, a, b in zip(self.output_names, got or [], want, strict=True):
                worst = float(np.abs(a - b).max())
                if not worst <= 1e-2 * max(float(np.abs(b).max()), 1e-6):
                    raise RuntimeError(f"the {rows} x {length} graph's {name} differs from a "
                                       f"run without graphs by {worst:.3g}")

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray] | None:
        """The outputs for ``inputs`` (int64, ``[rows, length]`` each), in the order of
        ``output_names``; None when no captured shape holds the batch."""
        rows, length = next(iter(inputs.values())).shape
        shape = pick_shape(self.shapes, rows, length)
        if shape is None:
            return None
        graph = self._graphs[shape]
        pad_into(graph.host, np.stack([inputs[name] for name in self.input_names]))
        values = self._replay(graph).copy_outputs_to_cpu()  # in output_names' order
        return [value[:rows, :length] if self._per_token[name] else value[:rows]
                for name, value in zip(self.output_names, values, strict=True)]

    def _replay(self, graph: _Graph) -> ort.IOBinding:
        for i, name in enumerate(self.input_names):
            graph.inputs[name].update_inplace(graph.host[i])  # the same device addresses
        binding = self.session.io_binding()
        for name, value in graph.inputs.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in graph.outputs.items():
            binding.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(binding, graph.options)
        return binding


def _output_shape(dims: Sequence[object], rows: int, length: int) -> list[int]:
    """An output's shape at (rows, length): its first dimension is the batch, another named
    one the sequence (per-token outputs), numbered ones fixed (an embedding's width)."""
    return [rows if i == 0 else dim if isinstance(dim, int) else length
            for i, dim in enumerate(dims)]
