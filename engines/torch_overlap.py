"""CUDA graphs launched without waiting: a batch's inputs copied in while the last batch runs.

``ShapeGraphs.run`` (engines/torch_cuda_graphs.py) pads a batch, copies it in, replays the
graph and waits for the outputs, so the device idles while the host pads the next batch. An
executor (workers/executor_loop.py) can do better: ``Launcher.launch`` pads a batch into one
of ``IN_FLIGHT`` slots of host buffers (pinned on CUDA), copies it to the device on a copy
stream of its own, and queues, on the engine's stream behind whatever runs there, the copy into
the graph's static input, the replay and the copy of the outputs back to the slot's host
buffer; it returns at once. ``GraphLaunch.result`` waits for that batch's outputs.

The slots are safe to reuse because of the contract of ``Engine.launch``: at most
``IN_FLIGHT`` launches wait for their result, taken in order, so slot k is written again only
after its last batch's outputs were taken (and so after its copies finished). The graphs'
static buffers need no slots: the engine's stream runs the copies and replays in order.

On the CPU (``TracedReplay``, for tests) the same steps run at once, in the same buffers.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from engines.base import IN_FLIGHT
from engines.shapes import pad_into, pick_shape
from engines.torch_cuda_graphs import CudaClock, Replay


class Slot:
    """One launch's buffers: per captured shape, its host input (and a device copy of it on
    CUDA) and its host output; and, on CUDA, the events and clock of its launch."""

    def __init__(self, replays: dict[tuple[int, int], Replay], device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = {shape: torch.zeros(tuple(r.static_input.shape), dtype=torch.int64,
                                        pin_memory=cuda) for shape, r in replays.items()}
        self.staged = {shape: torch.empty_like(r.static_input) for shape, r in replays.items()} \
            if cuda else {}
        self.out = {shape: torch.empty(tuple(r.static_output.shape), dtype=r.static_output.dtype,
                                       pin_memory=cuda) for shape, r in replays.items()}
        self.copied = torch.cuda.Event() if cuda else None
        self.done = torch.cuda.Event() if cuda else None
        self.clock = CudaClock(device) if cuda else None


class GraphLaunch:
    """One batch launched: ``result`` waits for it; then ``device_s`` is its device time (CUDA
    events; None on the CPU)."""

    def __init__(self, slot: Slot, shape: tuple[int, int], rows: int, length: int,
                 names: tuple[str, ...], per_token: bool) -> None:
        self._slot, self._shape, self._rows, self._length = slot, shape, rows, length
        self._names, self._per_token = names, per_token
        self.device_s: float | None = None

    def result(self) -> dict[str, np.ndarray]:
        """The batch's outputs, cut back to its rows (and length, per token), float32."""
        slot = self._slot
        if slot.done is not None:
            slot.done.synchronize()
        out = slot.out[self._shape]
        out = out[:, :self._rows, :self._length] if self._per_token else out[:, :self._rows]
        values = out.float().numpy().copy()  # the slot's buffer is written again later
        if slot.clock is not None:
            self.device_s = slot.clock.seconds()
        return dict(zip(self._names, values, strict=True))


class Launcher:
    """Launches batches on captured graphs through ``IN_FLIGHT`` slots (module docstring).

    Args:
        replays: The captured shapes (``ShapeGraphs.replays``).
        device: Where they run.
        names: The engine's output names.
        per_token: Outputs are ``[rows, length]`` (QA logits), else ``[rows, width]``.
    """

    def __init__(self, replays: dict[tuple[int, int], Replay], device: torch.device,
                 names: tuple[str, ...], per_token: bool) -> None:
        self.replays, self.device, self.names, self.per_token = replays, device, names, per_token
        self.shapes = sorted(replays)
        self.slots = [Slot(replays, device) for _ in range(IN_FLIGHT)]
        self._turn = itertools.cycle(self.slots)
        self.copy_stream: Any = torch.cuda.Stream(device=device) \
            if device.type == "cuda" else None

    @torch.inference_mode()
    def launch(self, stacked: np.ndarray) -> GraphLaunch | None:
        """Start a batch (``[inputs, rows, length]`` int64) on the captured shape that holds
        it; None where none does (the caller runs it otherwise)."""
        _, rows, length = stacked.shape
        shape = pick_shape(self.shapes, rows, length)
        if shape is None:
            return None
        slot, replay = next(self._turn), self.replays[shape]
        host = slot.host[shape]
        pad_into(host.numpy(), stacked)
        if self.copy_stream is None:
            replay.static_input.copy_(host)
            replay.replay()
            slot.out[shape].copy_(replay.static_output)
        else:
            self._queue(slot, shape, replay)
        return GraphLaunch(slot, shape, rows, length, self.names, self.per_token)

    def _queue(self, slot: Slot, shape: tuple[int, int], replay: Replay) -> None:
        """On CUDA: the copy in on the copy stream; the rest on the engine's stream after it."""
        assert slot.copied is not None and slot.done is not None and slot.clock is not None
        with torch.cuda.device(self.device):
            compute = torch.cuda.current_stream(self.device)
            self._queue_on(slot, shape, replay, compute)

    def _queue_on(self, slot: Slot, shape: tuple[int, int], replay: Replay, compute: Any) -> None:
        assert slot.copied is not None and slot.done is not None and slot.clock is not None
        with torch.cuda.stream(self.copy_stream):
            slot.staged[shape].copy_(slot.host[shape], non_blocking=True)
            slot.copied.record(self.copy_stream)
        compute.wait_event(slot.copied)
        replay.static_input.copy_(slot.staged[shape], non_blocking=True)
        slot.clock.start()
        replay.replay()
        slot.clock.stop()
        slot.out[shape].copy_(replay.static_output, non_blocking=True)
        slot.done.record(compute)
