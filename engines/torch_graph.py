"""The PyTorch engine's model as one TorchScript graph, so that a forward runs without the GIL.

Eager PyTorch lets go of the GIL around each operator and takes it back after each one. Beside
a thread that runs Python (a connection thread framing requests, a worker's main thread
tokenizing), every take-back waits for that thread to let go, up to the switch interval (5 ms):
a forward of a few hundred small operators then takes hundreds of milliseconds instead of one
(docs/benchmarks.md, "the GIL convoy"). A traced graph runs in TorchScript's interpreter, which
holds no GIL between its operators: a run takes the GIL back two or three times (the graph
call, and on a GPU the copies in and out).

Tracing records the operators one sample batch runs. A model whose Python branches on its
inputs would be recorded for that sample only, so the graph is checked against the eager model
on other shapes (one row, several, and the longest length served), each with a padded row,
before it is used; where tracing fails or the check disagrees, the engine runs eager and says
why. Under tracing, transformers always passes the attention mask (eager drops an all-ones
mask), so the traced graph runs masked attention even for a batch with no padding: on a GPU that
rules out the flash-attention kernel. A device-side assert during the trace (an input out of
the model's range) is not recoverable on CUDA; the samples stay inside the config's vocabulary
and token types.

``torch.jit.trace`` is deprecated in favour of ``torch.export`` and ``torch.compile``, whose
programs still run operator by operator under the GIL (``torch.export``) or need a compiler at
start-up (``torch.compile``); the ONNX export (preparation/export.py) traces the same way.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: The batch the graph is traced on, and the shapes it is checked on besides the longest served
#: length (rows, length).
TRACE_SHAPE = (2, 16)
CHECK_SHAPES = ((1, 7), (3, 40))
#: Largest accepted |traced - eager|, relative to the largest |eager| output, per precision. The
#: check runs the same operators and kernels both ways (masked attention), so they agree to
#: rounding.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}

Forward = Callable[[torch.Tensor], torch.Tensor]

# warnings.catch_warnings is not thread-safe, and sessions load their engines at once: one
# trace at a time, so that no load can leave another's warning filters in place.
_TRACE_LOCK = threading.Lock()


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


def sample_inputs(names: Sequence[str], rows: int, length: int, config: Any,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """Int64 inputs of shape ``[rows, length]`` in ``names`` order, as a task's collate makes them:
    token ids within the config's vocabulary, a mask whose last row is padded from half way, and
    type ids 0 then 1 (a question then a context; all 0 where the model has one token type)."""
    generator = torch.Generator().manual_seed(rows * 1000 + length)
    vocab = int(getattr(config, "vocab_size", None) or 2)
    second_type = 1 if int(getattr(config, "type_vocab_size", None) or 1) > 1 else 0
    tensors = []
    for name in names:
        value = torch.zeros((rows, length), dtype=torch.int64)
        if name == "input_ids":
            value = torch.randint(1, max(2, min(vocab, 1000)), (rows, length),
                                  generator=generator)
        elif name == "attention_mask":
            value = torch.ones((rows, length), dtype=torch.int64)
            value[-1, max(1, length // 2):] = 0
        elif name == "token_type_ids":
            value[:, length // 2:] = second_type
        tensors.append(value.to(device))
    return tuple(tensors)


def trace_checked(model: torch.nn.Module, names: Sequence[str], config: Any, longest: int,
                  device: torch.device, dtype: torch.dtype) -> tuple[Forward | None, str]:
    """``Stacked(model)`` traced (``model``: positional inputs in ``names`` order, a tuple of
    tensors out; ``config``: its transformers config; ``longest``: the longest length it will
    serve), and the reason when it is not: ``(graph, "")``, or ``(None, why)`` when tracing or
    the eager model failed, or the graph disagrees with the eager model on a check shape."""
    shapes = [*CHECK_SHAPES, (2, longest)]
    with _TRACE_LOCK:
        try:
            sample = torch.stack(sample_inputs(names, *TRACE_SHAPE, config, device))
            with warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore")  # trace-time notes on Python values, and the
                # deprecation of torch.jit.trace (see the module docstring)
                graph = torch.jit.trace(Stacked(model).eval(), sample, check_trace=False)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the eager model, said why
            return None, f"tracing failed: {type(exc).__name__}: {exc}"
        try:
            worst, shape = max((_difference(model, graph, sample_inputs(
                names, rows, length, config, device)), (rows, length)) for rows, length in shapes)
        except Exception as exc:  # noqa: BLE001
            return None, f"checking the traced graph failed: {type(exc).__name__}: {exc}"
    limit = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    if not worst <= limit:
        return None, (f"the traced graph differs from the eager model by {worst:.3g} of the "
                      f"largest output (more than {limit:g}) on {shape[0]} x {shape[1]} tokens")
    return graph, ""


def _difference(model: torch.nn.Module, graph: Forward, inputs: tuple[torch.Tensor, ...]) -> float:
    """Largest |graph - model| over every output, relative to the largest |model| output (inf
    when the outputs differ in number or shape)."""
    with torch.inference_mode():
        eager, traced = model(*inputs), run_graph(graph, torch.stack(inputs))
    if len(eager) != len(traced):
        return float("inf")
    pairs = list(zip(eager, traced, strict=True))
    if any(a.shape != b.shape for a, b in pairs):
        return float("inf")
    scale = max(float(a.float().abs().max()) for a, _ in pairs)
    worst = max(float((a.float() - b).abs().max()) for a, b in pairs) / max(scale, 1e-6)
    return worst if worst == worst else float("inf")  # NaN: as far apart as can be


def run_graph(graph: Forward, stacked: torch.Tensor) -> torch.Tensor:
    """One forward of a traced graph, in TorchScript's plain interpreter: no profiling runs and
    no fusion compiled per new shape, so the first batch of each shape costs what the rest do."""
    with torch.jit.optimized_execution(False):
        return graph(stacked)
