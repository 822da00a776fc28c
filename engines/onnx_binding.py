"""ONNX Runtime I/O binding: a batch's inputs copied once into device buffers kept per shape.

With ``session.run`` and numpy inputs, ONNX Runtime allocates device buffers, copies the inputs
in and the outputs back, for every batch. ``BoundRunner`` keeps one set of device input buffers
per batch shape (few shapes with ``--length_buckets``), writes a batch into them with one copy per
input, binds the two logit outputs to host memory, and runs. It works on any ONNX Runtime device;
the server uses it where the engine runs on CUDA, and the tests run it on the CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort

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
                 device: str = "cuda", device_id: int = 0) -> None:
        self.session = session
        self.output_names = tuple(output_names)
        self.device, self.device_id = device, device_id
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
        self.session.run_with_iobinding(binding)
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
