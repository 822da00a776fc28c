"""What a GPU engine's run spends on the host, part by part, as a simulated device charges it.

A CUDA-graph run's wall time (the cost curve's ``wall_ms``) is host work and device work:

========== ======================================================== ===== =========
part       what the real engine does                                GIL   when
========== ======================================================== ===== =========
pad        pads the batch into the graph's host input buffer        held  launch
copy_in    copies that buffer to the device                         free  launch
launch     the graph's replay call and its stream bookkeeping       held  launch
copy_out   copies the outputs back to host memory                   free  result
unpack     makes them numpy arrays and cuts them to the batch       held  result
========== ======================================================== ===== =========

The device's own time is the rest of the wall time. A simulated device (engines/sim_device.py)
spends each host part on the thread that launches the batch or takes its result, GIL held where
the real one holds it, and only the rest on the device; so the engine alone costs the curve's
wall time as before, but an executor that forms the next batch while the device runs this one
(``Engine.overlaps``) gains what the real one would, and the GIL parts contend with the
process's other threads as the real ones do.

Where the parts come from: a cost-curve cell's ``host_ms`` (``{part: ms}``, which the GPU check
measures per shape); else ``ESTIMATE``, a line per part in the batch's tokens. The estimate is
not measured part by part: it shares out the about 1.2 ms of host work per 32-row batch that
the executor's runs showed on an H100 (docs/benchmarks.md: 5.0-5.4 ms of engine wall time per
batch with the GPU running kernels 77% of it), by a guess at each part's share.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from engines.cost_curve import Cell


class Part(NamedTuple):
    """One host part of a run: whether it holds the GIL, and whether it comes at the launch
    (before the device) or at the result (after it)."""

    name: str
    gil: bool
    at_launch: bool


PARTS = (Part("pad", True, True), Part("copy_in", False, True), Part("launch", True, True),
         Part("copy_out", False, False), Part("unpack", True, False))
#: ms = fixed + per 1,000 tokens (rows x padded length), per part; see the module docstring.
ESTIMATE: dict[str, tuple[float, float]] = {
    "pad": (0.05, 0.02), "copy_in": (0.03, 0.01), "launch": (0.15, 0.0),
    "copy_out": (0.03, 0.01), "unpack": (0.10, 0.05)}
ESTIMATE_SOURCE = ("estimated: the H100 executor's 1.2 ms of host work per 32-row batch, "
                   "shared among its parts by a guess (engines/sim_host.py)")
#: The device keeps at least this share of a run's wall time, however large the host parts.
DEVICE_FLOOR = 0.1


def host_parts_ms(cell: Cell) -> dict[str, float]:
    """Each host part's ms for a run on ``cell``'s shape: the cell's measured ``host_ms`` where
    it has them, else ``ESTIMATE`` at the cell's tokens."""
    if cell.host_ms:
        return {part.name: float(cell.host_ms.get(part.name, 0.0)) for part in PARTS}
    tokens = cell.rows * cell.length / 1000
    return {name: fixed + per_k * tokens for name, (fixed, per_k) in ESTIMATE.items()}


def split_wall(wall_ms: float, parts: dict[str, float]) -> tuple[float, dict[str, float]]:
    """``(device ms, host parts' ms)`` of a run of ``wall_ms``, the parts shrunk in proportion
    where they would leave the device less than ``DEVICE_FLOOR`` of it."""
    host = sum(parts.values())
    room = wall_ms * (1 - DEVICE_FLOOR)
    if host > room:
        parts = {name: ms * room / host for name, ms in parts.items()}
        host = room
    return wall_ms - host, parts


def curve_source(curve_data: Mapping[str, Any]) -> str:
    """Where a curve's host parts come from, in words."""
    if any(cell.get("host_ms") for cell in curve_data.get("cells", [])):
        return "measured per shape by the GPU check"
    return ESTIMATE_SOURCE


class HostCharge:
    """Spends host parts on the calling thread: GIL-held parts spin in Python (which holds the
    GIL as the real work does, handing it over at the interpreter's switch interval); GIL-free
    parts (copies from pinned memory, which the copy engines do) sleep."""

    def spend(self, parts: Mapping[str, float], at_launch: bool, scale: float) -> None:
        """Spend the parts of one side (``at_launch`` or at the result), each ``ms / scale``."""
        for part in PARTS:
            ms = parts.get(part.name, 0.0)
            if part.at_launch != at_launch or ms <= 0:
                continue
            seconds = ms / 1e3 / scale
            if part.gil:
                _spin(seconds)
            else:
                time.sleep(seconds)


def _spin(seconds: float) -> None:
    """Busy Python for ``seconds`` (holds the GIL, as Python work does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
