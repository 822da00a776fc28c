"""An engine that costs what a GPU costs, on any machine: the zero engine's random outputs of the
right shape, after the host CPU of a launch and a simulated device's time (engines/sim_device.py).

``--inference_engine_type sim`` serves with it, laid out as on a GPU box: its device is
``cuda:N``'s simulated device N (``--cuda_devices`` gives several), it is device-bound (batches
fill up to the token budget), and its cost model learns from the device's time. Its answers are
random, so it serves nobody: it is for tests and for benchmarks of the GPU layout on machines
without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from engines.base import Launched
from engines.sim_device import RunCost, SimDevice, SimSettings, Ticket, device_index
from engines.zero_engine import ZeroEngine

SIM_ENGINE_WARNING = ("THIS SERVER'S ANSWERS ARE NOT MEANINGFUL: --inference_engine_type sim "
                      "runs no model; it answers from random logits after a simulated GPU's "
                      "time. It is for tests and benchmarks of the GPU layout, and serves nobody.")


class SimEngine(ZeroEngine):
    """Random outputs of the batch's shape, each run costing the real engine's host parts on
    the host and its turn on simulated device ``device_index(device)``. It overlaps, as PyTorch's
    CUDA graphs do: ``launch`` spends the host parts before the device and hands the device's
    time to the device's thread; the result spends the parts after it.

    Args:
        model_dir: A prepared model folder; only its serving.json is read.
        device: ``cuda:N`` or ``sim:N`` (N: the simulated device id; ``auto``, ``cuda``: 0).
        settings: The device's cost curve, scale, launch cost and files.
        max_tokens: The token budget (``--max_batch_tokens``): a batch whose padded shape is
            over it runs unpadded, as no CUDA graph holds it (0: none).
    """

    name = "sim"
    device_bound = True
    overlaps = True

    def __init__(self, model_dir: str | Path, *, device: str = "auto",
                 settings: SimSettings | None = None, max_tokens: int = 0) -> None:
        super().__init__(model_dir)
        self.sim = SimDevice(device_index(device), settings or SimSettings(), max_tokens)
        self.device = f"sim:{self.sim.index}"
        self.precision = self.sim.variant.precision
        self.row_steps = tuple(self.sim.curve.data["rows"])  # the GPU's captured row counts
        self.length_steps = tuple(self.sim.curve.data["lengths"])  # and lengths

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch on this thread: the host parts and the device's turn, then random
        outputs; ``device_s`` is the device time of the run."""
        rows, length = next(iter(feeds.values())).shape
        self.device_s = self.sim.run(rows, length)
        return super().run(feeds)

    def launch(self, feeds: Mapping[str, np.ndarray]) -> Launched:
        """The host parts before the device on this thread; the device's time on its own."""
        cost = self._cost(feeds)
        self.sim.charge(cost, at_launch=True)
        return SimLaunch(self, feeds, cost, self.sim.submit(cost.device_s))

    def _cost(self, feeds: Mapping[str, np.ndarray]) -> RunCost:
        rows, length = next(iter(feeds.values())).shape
        return self.sim.cost(rows, length)

    def device_busy(self) -> float | None:
        """The simulated device's busy fraction of late, every process's runs counted."""
        return self.sim.busy_share()

    def describe(self) -> str:
        """Says plainly that no model runs, and what the device follows."""
        return f"sim engine (random logits, no model) on {self.sim.describe()}"

    def close(self) -> None:
        """Let go of the device file."""
        self.sim.close()


class SimLaunch:
    """A batch on the simulated device: ``result`` waits for the device (sleeping, as a blocking
    CUDA wait), spends the host parts after it, and draws the outputs."""

    def __init__(self, engine: SimEngine, feeds: Mapping[str, np.ndarray], cost: RunCost,
                 ticket: Ticket) -> None:
        self._engine, self._feeds, self._cost, self._ticket = engine, feeds, cost, ticket
        self.device_s: float | None = None

    def result(self) -> dict[str, np.ndarray]:
        """The batch's outputs, once the device has run it."""
        self.device_s = self._ticket.wait()
        self._engine.sim.charge(self._cost, at_launch=False)
        return ZeroEngine.run(self._engine, self._feeds)
