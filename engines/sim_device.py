"""A simulated GPU: what one batch costs on a real one (its cost curve), scaled to this machine,
with the device's time taken in turns by every process that uses the same device id.

    device = SimDevice(index=0, settings=SimSettings())
    seconds = device.run(rows=8, length=256)  # host parts and the device's turn, this thread
    cost = device.cost(rows=8, length=256)   # the device's seconds and the host's parts
    device.charge(cost, at_launch=True)      # the host's parts before the device, this thread
    seconds = device.occupy(cost.device_s)   # waits its turn, then the device time, slept
    ticket = device.submit(cost.device_s)    # or queued on the device, as a launch is
    ticket.wait()                            # slept until the device has run it
    device.busy_share()                      # the device's busy fraction over the last seconds

What it costs (engines/cost_curve.py's file; by default the one the GPU check wrote on an H200):

- **a run's wall time**: the curve's median wall time of the smallest measured shape that holds
  the batch, as CUDA graphs pad a batch to the shape they captured (the server pads to its
  length buckets); where that shape is over the token budget, so that no graph holds the batch
  and it runs unpadded, the time between the two grid row counts around it, in proportion to
  rows; beyond the grid, in proportion to tokens; all divided by ``scale``;
- **its host parts** (``host``, on by default): the share of that wall time the real engine
  spends on the host (engines/sim_host.py: padding and copying the inputs in, the launch,
  copying the outputs out and unpacking them), spent on the thread that launches the batch or
  takes its result, GIL held where the real one holds it; the device gets the rest. With
  ``host`` off, the device gets the whole wall time;
- **turns**: the device is a timeline in the device's file: a run handed to it starts once the
  device has run everything handed to it before, by any process of the server that uses device
  id N (as a CUDA stream runs what was launched on it back to back, and contexts take turns
  without MPS), and the host need not wake between runs. The file also holds the device's total
  busy seconds, which every process adds to and reads.

``scale``: how fast the device is, against the one measured. ``auto`` makes it as fast, against
this machine's cores, as the measured GPU was against its machine's (16 cores): on 2 cores it is
2/16 of that GPU, so a simulated run takes 8 times the measured one, host parts included.
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from engines.cost_curve import Cell, CostCurve, Variant, load_cost_curve
from engines.sim_host import HostCharge, curve_source, host_parts_ms, split_wall

#: The cost curve the simulated device follows unless told otherwise: the GPU check's grid on
#: one H200 (2026-11-26, bert-base-sized, PyTorch fp16; docs/benchmarks.md).
DEFAULT_CURVE = Path(__file__).resolve().parent / "data" / "cost_curve_h200.json"
#: The device file: the device's busy seconds handed to it, over every process that used it, and
#: when (``time.monotonic``, the system's clock, which every process shares) it is free of them.
_LAYOUT = struct.Struct("dd")
#: How far back the busy share looks.
BUSY_WINDOW_S = 10.0


@dataclass(frozen=True)
class SimSettings:
    """How the simulated device behaves: its cost curve (a file; None: DEFAULT_CURVE), its speed
    against the measured GPU (``scale``; 0: ``auto``), whether runs spend the real engine's
    host parts on the host (``host``), and the folder of its device files, which the processes
    that share a device share (server.py makes one per server; None: a folder of this process's
    own, removed at its exit)."""

    curve: str | None = None
    scale: float = 0.0
    host: bool = True
    directory: str | None = None


@dataclass(frozen=True)
class RunCost:
    """One run's cost here: the device's seconds and the host parts' ms (before the scale)."""

    device_s: float
    host_ms: dict[str, float] = field(default_factory=dict)


class Ticket:
    """A run handed to the device: it ends at ``end`` (``time.monotonic``); ``wait`` returns its
    device seconds."""

    def __init__(self, seconds: float, end: float) -> None:
        self.seconds, self.end = seconds, end

    def wait(self) -> float:
        """Sleep (without burning a core) until the device has run this run."""
        time.sleep(max(0.0, self.end - time.monotonic()))
        return self.seconds


def device_index(device: str) -> int:
    """The simulated device id of a device name: ``cuda:N`` or ``sim:N`` is N; else 0.

    Raises:
        ValueError: an index that is not a non-negative integer.
    """
    _, _, index = device.partition(":")
    if not index:
        return 0
    if not index.isdigit():
        raise ValueError(f"a simulated device is named like cuda:0 or sim:0; got {device!r}")
    return int(index)


class SimDevice:
    """One simulated GPU as seen by one process (module docstring)."""

    def __init__(self, index: int, settings: SimSettings, max_tokens: int = 0) -> None:
        self.index = index
        self.settings = settings
        self.max_tokens = max_tokens  # the token budget CUDA graphs are captured within
        self.curve = load_cost_curve(settings.curve or DEFAULT_CURVE)
        self.variant = _gpu_variant(self.curve)
        _check_whole_grid(self.curve, self.variant)
        measured_cores = int(self.curve.data["machine"].get("cores") or 16)
        self.scale = settings.scale or (os.cpu_count() or 1) / measured_cores
        self.path = Path(settings.directory or _shared_dir()) / f"sim-device-{index}"
        self._fd, self._map = _open_device_file(self.path)
        self._host = HostCharge()
        self._lock = threading.Lock()  # the samples: session, stats and /metrics threads
        self._closed = False
        self._samples: deque[tuple[float, float]] = deque(maxlen=256)
        self._samples.append((time.monotonic(), self.busy_s()))

    def device_ms(self, rows: int, length: int) -> float:
        """Milliseconds one run of ``rows`` x ``length`` takes here, host parts and device
        (after the scale): the curve's wall time."""
        wall_ms, _ = self._wall_ms(rows, length)
        return wall_ms / self.scale

    def cost(self, rows: int, length: int) -> RunCost:
        """One run's device seconds and host parts (module docstring)."""
        wall_ms, cell = self._wall_ms(rows, length)
        if not self.settings.host:
            return RunCost(wall_ms / self.scale / 1e3)
        share = wall_ms / cell.wall_ms_median  # the cell's parts, to this run's wall time
        parts = {name: ms * share for name, ms in host_parts_ms(cell).items()}
        device_ms, parts = split_wall(wall_ms, parts)
        return RunCost(device_ms / self.scale / 1e3, parts)

    def _wall_ms(self, rows: int, length: int) -> tuple[float, Cell]:
        """The curve's wall ms for a run (before the scale) and the cell it is read from."""
        grid_rows, grid_lengths = self.curve.data["rows"], self.curve.data["lengths"]
        fit_rows, fit_length = min(rows, grid_rows[-1]), min(length, grid_lengths[-1])
        cell = self.curve.lookup(self.variant, fit_rows, fit_length)
        beyond = (rows / fit_rows) * (length / fit_length)  # past the grid: by tokens
        below = max((r for r in grid_rows if r < fit_rows), default=None)
        if self.max_tokens and cell.rows * cell.length > self.max_tokens and \
                below is not None and fit_rows not in grid_rows:  # no graph: its own rows
            low = self.curve.lookup(self.variant, below, fit_length).wall_ms_median
            share = (fit_rows - below) / (cell.rows - below)
            return (low + share * (cell.wall_ms_median - low)) * beyond, cell
        return cell.wall_ms_median * beyond, cell

    def run(self, rows: int, length: int) -> float:
        """One run on this thread: its host parts and the device's turn; returns the device's
        seconds."""
        cost = self.cost(rows, length)
        self.charge(cost, at_launch=True)
        seconds = self.occupy(cost.device_s)
        self.charge(cost, at_launch=False)
        return seconds

    def charge(self, cost: RunCost, at_launch: bool) -> None:
        """Spend a run's host parts of one side on this thread (after the scale)."""
        self._host.spend(cost.host_ms, at_launch, self.scale)

    def occupy(self, seconds: float) -> float:
        """Wait for the device, then keep it busy for ``seconds``; returns them (what CUDA
        events would give)."""
        seconds = self.submit(seconds).wait()
        now = time.monotonic()
        with self._lock:
            if now - self._samples[-1][0] >= 0.1:
                self._samples.append((now, self.busy_s()))
        return seconds

    def submit(self, seconds: float) -> Ticket:
        """Hand ``seconds`` of device time to the device: they run once it is free of every
        run handed to it before (by any process), back to back, as a CUDA stream runs what was
        launched on it; nothing on the host wakes between runs."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            busy, free_at = _LAYOUT.unpack_from(self._map, 0)
            end = max(time.monotonic(), free_at) + seconds
            _LAYOUT.pack_into(self._map, 0, busy + seconds, end)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return Ticket(seconds, end)

    def busy_s(self) -> float:
        """The device's busy seconds so far, over every process that uses it: those handed to
        it, less what it has still to run (from now until it is free, busy throughout)."""
        busy, free_at = _LAYOUT.unpack_from(self._map, 0)
        return float(busy - max(0.0, free_at - time.monotonic()))

    def busy_share(self) -> float | None:
        """The device's busy fraction over about the last BUSY_WINDOW_S seconds, every
        process's runs counted (over a longer span where this process took no sample within
        it at least half a second old: since the last one before it, or since this process
        opened the device); None once closed."""
        with self._lock:
            if self._closed:
                return None
            now, busy = time.monotonic(), self.busy_s()
            samples = list(self._samples)
            self._samples.append((now, busy))
        start = next(((t, b) for t, b in samples if now - BUSY_WINDOW_S <= t <= now - 0.5), None)
        if start is None:
            older = [(t, b) for t, b in samples if t < now - BUSY_WINDOW_S]
            start = older[-1] if older else samples[0]
        then, busy_then = start
        return min(1.0, max(0.0, (busy - busy_then) / max(now - then, 1e-6)))

    def describe(self) -> str:
        """``simulated cuda:0 at 0.125 x pytorch cuda:0 fp16 cudagraphs (NVIDIA H200)``."""
        gpu = self.curve.data["machine"].get("gpu") or "unknown GPU"
        host = "host parts " + ("on" if self.settings.host else "off")
        return (f"simulated device {self.index} at {self.scale:.3g} x {self.variant.label()} "
                f"({gpu}), {host}")

    def host_source(self) -> str:
        """Where the host parts it spends come from, in words."""
        return curve_source(self.curve.data) if self.settings.host else "off"

    def close(self) -> None:
        """Let go of the device file (it stays for the other processes)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._map.close()
        os.close(self._fd)


def _gpu_variant(curve: CostCurve) -> Variant:
    """The curve's first variant measured on a GPU (the GPU check measures CUDA graphs first).

    Raises:
        ValueError: the curve has no GPU variant.
    """
    for variant in curve.variants():
        if variant.device.startswith("cuda"):
            return variant
    raise ValueError("this cost curve has no cells measured on a GPU (cuda:N): a simulated "
                     "device follows a GPU's costs")


def _check_whole_grid(curve: CostCurve, variant: Variant) -> None:
    """Raise unless ``variant`` was measured at every shape of the grid (the GPU check skips
    the cells its time did not reach), so that no run can find its shape missing.

    Raises:
        ValueError: naming the first shapes missing.
    """
    missing = [f"{rows} x {length}" for rows in curve.data["rows"]
               for length in curve.data["lengths"] if (variant, rows, length) not in curve.cells]
    if missing:
        raise ValueError(f"the cost curve's {variant.label()} misses {len(missing)} shapes "
                         f"({', '.join(missing[:4])}...): a simulated device needs the whole "
                         "grid; run the GPU check with time for it")


def new_folder_name() -> str:
    """A fresh name for the device files of one server's processes (its own, shared by its
    workers); nothing is made until an engine opens a device there."""
    return os.path.join(tempfile.gettempdir(), f"qa-sim-{os.getpid()}-{uuid.uuid4().hex[:12]}")


_own_dir: str | None = None


def _shared_dir() -> str:
    """A folder of this process's own (its devices are its own), removed at its exit."""
    global _own_dir
    if _own_dir is None:
        _own_dir = tempfile.mkdtemp(prefix="qa-sim-")
        atexit.register(shutil.rmtree, _own_dir, True)
    return _own_dir


def _open_device_file(path: Path) -> tuple[int, mmap.mmap]:
    """The device file (its folder too), created with zero busy seconds and free by whoever
    comes first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        if os.fstat(fd).st_size < _LAYOUT.size:
            os.ftruncate(fd, _LAYOUT.size)
            os.pwrite(fd, _LAYOUT.pack(0.0, 0.0), 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    return fd, mmap.mmap(fd, _LAYOUT.size)
