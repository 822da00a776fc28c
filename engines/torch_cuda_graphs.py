"""CUDA graphs for the PyTorch engine: the traced graph captured once per batch shape.

A traced forward still launches a few hundred kernels per run from the host; a CUDA graph
replays them all with one launch. The shapes captured, the one a batch runs on and its padding
are engines/shapes.py's (shared with the ONNX engine); each shape here has its own static input
and output buffers, all drawing on one memory pool (this docstring's last paragraph). A batch
no captured shape holds (more rows, or longer) runs the traced graph.

The capture and replay of one shape is a small seam, ``Capture`` -> ``Replay``: on CUDA,
``CudaGraphCapture`` records a ``torch.cuda.CUDAGraph``; on the CPU, ``TracedReplay`` runs the
traced graph on the same static buffers, so that the padding, the choice of shape and the
checks are tested without a GPU. Each shape is checked after capture: a replay on sample inputs
must give the traced graph's outputs.

Memory: graphs captured into one pool share it, largest shape first, so the pool holds about
what the largest shape's forward needs, not the sum over shapes. That is safe because one
engine replays its graphs one at a time, from its session's thread, and copies each output to
the host before the next replay (a later capture may reuse an earlier one's scratch memory).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from engines.shapes import pad_into, pick_shape
from engines.torch_graph import TOLERANCE, Forward, run_graph, sample_inputs

#: Runs of the traced graph on the capture stream before each capture (cuBLAS workspaces and
#: the like are allocated outside the graph).
WARMUP_RUNS = 2

# One capture at a time in a process: sessions load their engines at once, and a capture must
# not interleave with another's on the same device.
_CAPTURE_LOCK = threading.Lock()


class Replay(Protocol):
    """One captured shape: its static buffers, and a replay that reads ``static_input`` and
    writes ``static_output`` in place."""

    static_input: torch.Tensor
    static_output: torch.Tensor

    def replay(self) -> None: ...


#: Captures ``forward`` on a static input (``[inputs, rows, length]`` int64, on the device).
Capture = Callable[[Forward, torch.Tensor], Replay]


class TracedReplay:
    """The CPU stand-in for a CUDA graph: a replay runs the traced graph on the static input and
    copies its result into the static output, as a graph replay writes it.

    Args:
        forward: The traced graph.
        static_input: The shape's input buffer.
    """

    def __init__(self, forward: Forward, static_input: torch.Tensor) -> None:
        self.forward = forward
        self.static_input = static_input
        with torch.inference_mode():
            self.static_output = run_graph(forward, static_input)

    def replay(self) -> None:
        """Run the traced graph on ``static_input`` into ``static_output``."""
        with torch.inference_mode():
            self.static_output.copy_(run_graph(self.forward, self.static_input))


class CudaGraphReplay:
    """A captured ``torch.cuda.CUDAGraph`` and its static buffers."""

    def __init__(self, graph: Any, static_input: torch.Tensor,
                 static_output: torch.Tensor) -> None:
        self.graph = graph
        self.static_input = static_input
        self.static_output = static_output

    def replay(self) -> None:
        """Launch the graph on the current stream."""
        self.graph.replay()


class CudaGraphCapture:
    """Captures CUDA graphs on one device, all on one side stream and into one memory pool.

    Args:
        device: The CUDA device the traced graph runs on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Forward, static_input: torch.Tensor) -> CudaGraphReplay:
        """Warm ``forward`` up on the side stream, then capture one run of it."""
        graph = torch.cuda.CUDAGraph()
        with _CAPTURE_LOCK, torch.cuda.device(self.device), torch.inference_mode():
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUP_RUNS):
                    run_graph(forward, static_input)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            # thread_local: another session's engine may load or serve meanwhile
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                static_output = run_graph(forward, static_input)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return CudaGraphReplay(graph, static_input, static_output)


class CudaClock:
    """Device time of a stretch of work on ``device``'s current stream, by CUDA events: what the
    GPU spent between ``start`` and ``stop``, not the host's waits (for the GIL, say) around it,
    except a wait between ``start`` and the first launch after it.

    Args:
        device: The engine's CUDA device (not necessarily the thread's current one: a worker
            may run on cuda:1).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = torch.cuda.Event(enable_timing=True)
        self._stop = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        """Mark the start on the device's current stream."""
        self._start.record(torch.cuda.current_stream(self.device))

    def stop(self) -> None:
        """Mark the end on the device's current stream."""
        self._stop.record(torch.cuda.current_stream(self.device))

    def seconds(self) -> float:
        """Seconds between the marks (waits until the end is reached)."""
        self._stop.synchronize()
        return self._start.elapsed_time(self._stop) / 1000


class ShapeGraphs:
    """One replay per captured shape, and the padding of a batch to the shape it runs on.

    Build it with :meth:`capture`. Args: ``replays``: shape (rows, length) -> its replay;
    ``per_token``: outputs are ``[rows, length]`` (QA logits) and are cut back to the batch's
    length; otherwise ``[rows, width]``, cut back to its rows only.
    """

    def __init__(self, replays: dict[tuple[int, int], Replay], per_token: bool) -> None:
        self.replays = replays
        self.per_token = per_token
        self.shapes = sorted(replays)
        # the host side of each shape's input, padded there and copied in one go
        self._host = {shape: np.zeros(tuple(replay.static_input.shape), dtype=np.int64)
                      for shape, replay in replays.items()}

    @classmethod
    def capture(cls, forward: Forward, capture: Capture, shapes: Sequence[tuple[int, int]],
                names: Sequence[str], config: Any, device: torch.device, dtype: torch.dtype,
                per_token: bool) -> ShapeGraphs:
        """Capture ``forward`` at every shape (in the order given: largest first shares the
        pool best), each checked by a replay on sample inputs (not those it was captured on)
        against ``forward`` itself.

        Args:
            names, config: The model's input names and transformers config (sample inputs).
            dtype: The model's dtype (the check's tolerance).

        Raises:
            RuntimeError: a replay disagrees with the traced graph (or what capture raised).
        """
        replays: dict[tuple[int, int], Replay] = {}
        limit = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
        with torch.inference_mode():
            for rows, length in shapes:
                sample = torch.stack(sample_inputs(names, rows, length, config, device))
                # captured on other inputs than it is checked on, so that a replay that does
                # not read its static input fails the check
                replay = capture(forward, sample.flip(-1).contiguous())
                replays[(rows, length)] = replay
                replay.static_input.copy_(sample)
                replay.replay()
                want = run_graph(forward, sample)
                worst = float((replay.static_output - want).abs().max())
                scale = max(float(want.abs().max()), 1e-6)
                if not worst <= limit * scale:
                    raise RuntimeError(f"the {rows} x {length} graph's replay differs from the "
                                       f"traced graph by {worst / scale:.3g} of the largest "
                                       "output")
        return cls(replays, per_token)

    def describe(self) -> str:
        """The captured shapes, in words."""
        lengths = sorted({n for _, n in self.shapes})
        return (f"CUDA graphs of the traced graph for {len(self.shapes)} shapes (rows up to "
                f"{max(r for r, _ in self.shapes)}, lengths {','.join(map(str, lengths))})")

    @torch.inference_mode()
    def run(self, stacked: np.ndarray,
            clock: CudaClock | None = None) -> tuple[np.ndarray, tuple[int, int]] | None:
        """Run a batch (``[inputs, rows, length]`` int64) on the captured shape that holds it.

        Returns:
            The outputs (``[outputs, rows, length]`` per token, else ``[outputs, rows, width]``,
            float32) and the shape replayed; None when no captured shape holds the batch.
        """
        _, rows, length = stacked.shape
        shape = pick_shape(self.shapes, rows, length)
        if shape is None:
            return None
        host, replay = self._host[shape], self.replays[shape]
        pad_into(host, stacked)
        replay.static_input.copy_(torch.from_numpy(host), non_blocking=True)
        if clock is not None:
            clock.start()
        replay.replay()
        if clock is not None:
            clock.stop()
        out = replay.static_output[:, :rows, :length] if self.per_token else \
            replay.static_output[:, :rows]
        return out.to("cpu", copy=True).numpy(), shape


def capture_checked(forward: Forward, capture: Capture | None, shapes: Sequence[tuple[int, int]],
                    names: Sequence[str], config: Any, device: torch.device, dtype: torch.dtype,
                    per_token: bool) -> tuple[ShapeGraphs | None, str]:
    """``forward`` captured at ``shapes`` (see :meth:`ShapeGraphs.capture`), and the reason
    when it is not: ``(graphs, "")`` or ``(None, why)``, ``why`` one line.

    Args:
        capture: How to capture one shape; None: a ``CudaGraphCapture`` on a CUDA ``device``
            (elsewhere there is nothing to capture with).
    """
    if capture is None and device.type != "cuda":
        return None, f"torch sees no CUDA device (the engine runs on {device})"
    if "attention_mask" not in names:
        return None, "the model takes no attention_mask, so padding would change its outputs"
    try:
        graphs = ShapeGraphs.capture(forward, capture or CudaGraphCapture(device), shapes,
                                     names, config, device, dtype, per_token)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the traced graph, said why
        words = (str(exc).strip().splitlines() or [""])[0]
        return None, f"capture failed: {type(exc).__name__}: {words}"
    return graphs, ""
