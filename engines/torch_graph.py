"""The PyTorch engine's model as one TorchScript graph, so that a forward runs without the GIL.

Eager PyTorch lets go of the GIL around each operator and takes it back after each one. Beside
a thread that runs Python (a connection thread framing requests, a worker's main thread
tokenizing), every take-back waits for that thread to let go, up to the switch interval (5 ms):
a forward of a few hundred small operators then takes hundreds of milliseconds instead of one
(docs/benchmarks.md, "the GIL convoy"). A traced graph runs in TorchScript's interpreter, which
holds no GIL between its operators: the forward takes the GIL once on the way in and once on the
way out.

Tracing records the operators one sample batch runs. A model whose Python branches on its
inputs' values would be recorded for that sample only, so the graph is checked against the eager
model on two other shapes, padded rows among them, before it is used; where tracing fails or
the check disagrees, the engine runs eager and says why. ``torch.jit.trace`` is deprecated in
favour of ``torch.export`` and ``torch.compile``, whose programs still run operator by operator
under the GIL (``torch.export``) or need a compiler at start-up (``torch.compile``); the ONNX
export (engines/export.py) traces the same way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

#: The batch the graph is traced on, and the shapes it is checked on (rows, length).
TRACE_SHAPE = (2, 16)
CHECK_SHAPES = ((1, 7), (3, 40))
#: Largest accepted |traced - eager| per precision: the same operators run, so they agree to
#: rounding (fp32: prepare_model.py's default ONNX tolerance).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}

Forward = Callable[[torch.Tensor], torch.Tensor]


class Stacked(torch.nn.Module):
    """A task model with one tensor in (its inputs stacked, ``[inputs, rows, length]``) and one
    out (its outputs stacked, float32): every tensor call from Python lets go of the GIL and
    takes it back, so a run makes as few as it can (one copy in, the graph, one copy out).

    Args:
        model: Positional int64 inputs in, a tuple of same-shaped outputs out (TaskOutputs).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, stacked: torch.Tensor) -> torch.Tensor:
        """The model's outputs, stacked, in float32."""
        return torch.stack([output.float() for output in self.model(*stacked.unbind(0))])


def sample_inputs(names: Sequence[str], rows: int, length: int, vocab_size: int,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """Int64 inputs of shape ``[rows, length]`` in ``names`` order, as a task's collate makes them:
    token ids, a mask whose last row is padded from half way (when there are rows to spare), and
    type ids 0 then 1 (a question then a context)."""
    generator = torch.Generator().manual_seed(rows * 1000 + length)
    tensors = []
    for name in names:
        if name == "input_ids":
            value = torch.randint(1, max(2, min(vocab_size, 1000)), (rows, length),
                                  generator=generator)
        elif name == "attention_mask":
            value = torch.ones((rows, length), dtype=torch.int64)
            if rows > 1:
                value[-1, length // 2:] = 0
        elif name == "token_type_ids":
            value = torch.zeros((rows, length), dtype=torch.int64)
            value[:, length // 2:] = 1
        else:
            value = torch.zeros((rows, length), dtype=torch.int64)
        tensors.append(value.to(device))
    return tuple(tensors)


def trace_checked(model: torch.nn.Module, names: Sequence[str], vocab_size: int,
                  device: torch.device, dtype: torch.dtype) -> tuple[Forward | None, str]:
    """``Stacked(model)`` traced (``model``: positional inputs in ``names`` order, a tuple of
    tensors out), and the reason when it is not: ``(graph, "")``, or ``(None, why)`` when
    tracing failed or the graph disagrees with the eager model on the check shapes."""
    try:
        sample = torch.stack(sample_inputs(names, *TRACE_SHAPE, vocab_size, device))
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # trace-time notes on Python values, and the
            # deprecation of torch.jit.trace (see the module docstring)
            graph = torch.jit.trace(Stacked(model).eval(), sample, check_trace=False)
        worst = max(_difference(model, graph, sample_inputs(names, rows, length, vocab_size,
                                                            device))
                    for rows, length in CHECK_SHAPES)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the eager model, said why
        return None, f"tracing failed: {type(exc).__name__}: {exc}"
    limit = TOLERANCE.get(dtype, 1e-3)
    if not worst <= limit:
        return None, (f"the traced graph differs from the eager model by {worst:.3g} "
                      f"(more than {limit:g}) on a shape it was not traced on")
    return graph, ""


def _difference(model: torch.nn.Module, graph: Forward, inputs: tuple[torch.Tensor, ...]) -> float:
    """Largest |graph - model| over every output, in float32 (inf on a shape mismatch)."""
    with torch.inference_mode():
        eager, traced = model(*inputs), run_graph(graph, torch.stack(inputs))
    if len(eager) != len(traced):
        return float("inf")
    pairs = list(zip(eager, traced, strict=True))
    if any(a.shape != b.shape for a, b in pairs):
        return float("inf")
    return max(float((a.float() - b).abs().max()) for a, b in pairs)


def run_graph(graph: Forward, stacked: torch.Tensor) -> torch.Tensor:
    """One forward of a traced graph, in TorchScript's plain interpreter: no profiling runs and
    no fusion compiled per new shape, so the first batch of each shape costs what the rest do."""
    with torch.jit.optimized_execution(False):
        return graph(stacked)
