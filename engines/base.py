"""The engine contract: numpy tensors in, numpy tensors out, batch dimension first.

What an engine returns depends on the model folder's task (serving.json's ``task`` and
``output_names``): ``TASK_OUTPUT_NAMES`` lists the built-in tasks' outputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Protocol

import numpy as np

#: Batches an overlapping engine may hold launched and not yet taken (``Engine.overlaps``): one
#: on the device and the next copied in behind it.
IN_FLIGHT = 2
#: Output tensor names every QA engine produces, in this order.
QA_OUTPUT_NAMES: tuple[str, str] = ("start_logits", "end_logits")
#: The engine outputs of each built-in task's models, in order: ``qa``: ``[rows, seq_len]``
#: logits each; ``embed``: ``[rows, dim]`` L2-normalised vectors; ``classify``: ``[rows, labels]``
#: logits.
TASK_OUTPUT_NAMES: dict[str, tuple[str, ...]] = {
    "qa": QA_OUTPUT_NAMES, "embed": ("embeddings",), "classify": ("logits",)}


class Launched(Protocol):
    """A batch an engine has started (:meth:`Engine.launch`): ``result`` waits for its outputs,
    then ``device_s`` holds what the device spent on it (None: not measured)."""

    device_s: float | None

    def result(self) -> dict[str, np.ndarray]: ...


class Done:
    """A batch that has run already: the default :meth:`Engine.launch`'s."""

    def __init__(self, outputs: dict[str, np.ndarray], device_s: float | None) -> None:
        self.outputs, self.device_s = outputs, device_s

    def result(self) -> dict[str, np.ndarray]:
        """The outputs."""
        return self.outputs


class Engine(ABC):
    """A loaded model that runs one batch at a time.

    An engine is owned by one inference-session thread and need not be thread-safe, unless it
    says ``shareable``: then every session of a model in one process runs batches on the same
    engine at once, so the process holds one copy of the weights. Subclasses set
    ``name`` (e.g. ``"onnx"``), ``device`` (e.g. ``"cpu"``, ``"cuda:0"``), ``input_names``,
    ``output_names`` (the model's, as serving.json names them; QA's by default) and ``precision``
    when it runs other than fp32.

    Two optional figures tell batching what the engine knows of its device (docs/batching.md):

    - ``device_bound``: True where a device apart from the host (a GPU) runs each batch, so that
      a bigger batch costs little more than a small one and the host's time (waits for the GIL
      among it) says little of the batch's cost: sessions then fill each batch up to the caps
      (the token budget) whenever requests wait, whatever the cost model says.
    - ``device_s``: seconds the device spent on the last ``run``, where the engine measures it
      (PyTorch on CUDA: CUDA events), set by every run; None: the session times runs by the
      wall clock. The cost model learns from it, so host waits do not make batching look dear.
    - ``row_steps``, ``length_steps``: the row counts and lengths the engine runs batches at,
      where it pads a batch up to the next of each (CUDA graphs, captured per shape); None: it
      runs any. The cost model then knows that 33 rows cost what 64 do, and 30 tokens what 64
      do, and batches are cut to fill a step.
    - ``overlaps``: :meth:`launch` returns once the batch is on its way to the device, so the
      caller (an executor, workers/executor_loop.py) can form and copy in the next batch while
      this one runs; at most ``IN_FLIGHT`` launches may be waiting for their ``result``.
    """

    name: str = "engine"
    device: str = "cpu"
    precision: str = "fp32"
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = QA_OUTPUT_NAMES
    device_bound: bool = False
    device_s: float | None = None
    row_steps: tuple[int, ...] | None = None
    length_steps: tuple[int, ...] | None = None
    overlaps: bool = False
    #: ``run`` may be called from several threads at once (and sets no ``device_s``): the
    #: sessions of one model in one process then share this engine (engines/sharing.py).
    shareable: bool = False

    @abstractmethod
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch.

        Args:
            feeds: One int64 array of shape ``[rows, seq_len]`` per name in ``input_names``.

        Returns:
            One float32 array per name in ``output_names``, ``rows`` first: ``[rows, seq_len]``
            for QA logits, ``[rows, dim]`` for embeddings, ``[rows, labels]`` for class logits.
        """

    def launch(self, feeds: Mapping[str, np.ndarray]) -> Launched:
        """Start one batch (see ``overlaps``); its ``result`` gives :meth:`run`'s outputs. The
        default runs it now. Launches are answered in order: take each one's ``result`` before
        a later one's."""
        outputs = self.run(feeds)
        return Done(outputs, self.device_s)

    def run_by(self, feeds: Mapping[str, np.ndarray],
               deadline: float | None) -> dict[str, np.ndarray]:
        """Run one batch whose answers nobody takes after ``deadline`` (``time.monotonic()``;
        None: no deadline). An engine that queues batches behind others (an executor's) drops
        one whose deadline passes first, raising ``protocol.errors.DeadlineExceeded``, and
        raises its other failures typed too (``ServerError``); one that runs it at once runs
        it (the default)."""
        return self.run(feeds)

    def device_busy(self) -> float | None:
        """The device's busy fraction of late, where the engine knows it (the simulated
        device: every process's runs on it); None: unknown (the default)."""
        return None

    def release_memory(self) -> None:
        """Give back what the runtime kept of past batches' working memory (called when the
        model has been idle a moment, while other threads may run batches); the default does
        nothing."""

    def memory_figures(self) -> dict[str, float]:
        """Memory the engine knows it holds, in MB (``device_mb``: on its GPU); empty where it
        knows none (the default)."""
        return {}

    def close(self) -> None:
        """Release the engine's resources; the default does nothing."""

    def describe(self) -> str:
        """One line saying what runs where, for logs."""
        return f"{self.name} on {self.device}"


def check_outputs(feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
    """Raise ``ValueError`` unless every output has exactly one row per input row."""
    rows = next(iter(feeds.values())).shape[0]
    for name, value in outputs.items():
        if value.shape[0] != rows:
            raise ValueError(f"engine output {name!r} has {value.shape[0]} rows for {rows} inputs")
