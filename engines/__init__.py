"""Inference engines: the runtimes (ONNX Runtime, PyTorch, and a zero-cost stand-in), each taking
a batch of rows as numpy arrays and returning the model's named outputs. What a task does with
them lives in tasks/; how a model folder is made, in preparation/."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from engines.base import Engine
from engines.sim_device import SimSettings

#: "zero" runs no model (random logits at once): for benchmarks of the server's own work only.
#: "sim" runs no model either, but costs what a GPU does (engines/sim_engine.py): for tests and
#: benchmarks of the GPU layout without a GPU.
ENGINE_TYPES = ("onnx", "pytorch", "zero", "sim")
#: Arithmetic an engine may be asked for; where it cannot honour one it says so and runs fp32.
PRECISIONS = ("fp32", "fp16", "bf16")
#: How a PyTorch engine can run its model: the traced graph captured as CUDA graphs, one per
#: batch shape (engines/torch_cuda_graphs.py; CUDA only, else it runs the traced graph); one
#: traced graph, which holds no GIL between operators (engines/torch_graph.py); or eager,
#: operator by operator.
TORCH_GRAPHS = ("cudagraphs", "traced", "eager")
#: The default graph setting: "cudagraphs" on CUDA, "traced" elsewhere.
TORCH_GRAPH_AUTO = "auto"
#: Engines whose run lets go of the GIL and takes it back more than once (PyTorch: after every
#: operator when eager, two or three times per run when traced), not once for the whole run
#: (ONNX Runtime). Beside a thread that holds the GIL, each take-back waits up to the switch
#: interval (5 ms): the GIL convoy. Worker processes tokenize with the GIL released beside them.
GIL_RETAKING = frozenset({"pytorch"})
#: The server settings whose values these are (settings/choices.py).
SETTING_CHOICES = {"inference_engine_type": ENGINE_TYPES, "precision": PRECISIONS,
                   "pytorch_graph": (TORCH_GRAPH_AUTO, *TORCH_GRAPHS)}


def load_engine(kind: str, model_dir: str | Path, *, device: str = "auto", threads: int = 0,
                lone_threads: int = 0, crowded: Callable[[], bool] | None = None,
                precision: str = "fp32", graph: str = TORCH_GRAPH_AUTO,
                lengths: Sequence[int] = (), max_seq_len: int = 0,
                max_tokens: int = 0, onnx_cuda_graphs: bool = False,
                sim: SimSettings | None = None) -> Engine:
    """Load one engine of ``kind`` (one of ENGINE_TYPES) from a prepared model folder.

    ``threads``: CPU threads of a batch (0: the runtime chooses). ``lone_threads`` and
    ``crowded`` (ONNX on the CPU): threads for a batch that has the machine to itself, and how
    to tell (see OnnxEngine). ``precision``: one of PRECISIONS (the engine
    logs why, where it falls back to fp32). ``graph`` (PyTorch): "auto" or one of TORCH_GRAPHS;
    ``lengths``, ``max_seq_len`` and ``max_tokens`` (CUDA graphs): the server's length buckets,
    longest length and token budget, which set the shapes captured (engines/shapes.py).
    ``onnx_cuda_graphs``: the ONNX engine on CUDA replays CUDA graphs (see OnnxEngine).
    ``sim``: the simulated device's settings (engines/sim_device.py).

    The backend is imported only here, so a server using ONNX never imports torch's CUDA stack.
    """
    if kind == "onnx":
        from engines.onnx_engine import OnnxEngine

        return OnnxEngine(model_dir, device=device, intra_op_threads=threads,
                          lone_threads=lone_threads, crowded=crowded, precision=precision,
                          cuda_graphs=onnx_cuda_graphs, lengths=lengths,
                          max_seq_len=max_seq_len, max_tokens=max_tokens)
    if kind == "pytorch":
        from engines.torch_engine import TorchEngine

        return TorchEngine(model_dir, device=device, threads=threads, precision=precision,
                           graph=graph, lengths=lengths, max_seq_len=max_seq_len,
                           max_tokens=max_tokens)
    if kind == "zero":
        from engines.zero_engine import ZeroEngine

        return ZeroEngine(model_dir)
    if kind == "sim":
        from engines.sim_engine import SimEngine

        return SimEngine(model_dir, device=device, settings=sim, max_tokens=max_tokens)
    raise ValueError(f"unknown engine type {kind!r}; choose from {ENGINE_TYPES}")
