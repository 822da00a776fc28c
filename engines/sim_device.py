"""A simulated GPU: what one batch costs on a real one (its cost curve), scaled to this machine,
with the device's time taken in turns by every process that uses the same device id.

    device = SimDevice(index=0, settings=SimSettings())
    device.launch(rows=8, length=256)     # host CPU for the launch, on this thread, GIL released
    seconds = device.run(rows=8, length=256)   # waits its turn, then the device time, slept
    device.busy_share()                   # the device's busy fraction over the last seconds

What it costs (engines/cost_curve.py's file; by default the one the GPU check wrote on an H200):

- **device time per run**: the curve's median wall time of the smallest measured shape that holds
  the batch, as CUDA graphs pad a batch to the shape they captured (the server pads to its
  length buckets); where that shape is over the token budget, so that no graph holds the batch
  and it runs unpadded, the time between the two grid row counts around it, in proportion to
  rows; beyond the grid, in proportion to tokens; all divided by ``scale``;
- **host CPU per run**: ``launch_ms``, burnt on the calling thread in a hash over a buffer, which
  releases the GIL, as a CUDA launch and copy do;
- **turns**: the device time is spent holding an exclusive ``flock`` on the device's file, so the
  processes of one server that use device id N take turns, as CUDA contexts do without MPS.
  The file also holds the device's total busy seconds, which every process adds to and reads.

``scale``: how fast the device is, against the one measured. ``auto`` makes it as fast, against
this machine's cores, as the measured GPU was against its machine's (16 cores): on 2 cores it is
2/16 of that GPU, so a simulated run takes 8 times the measured one.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from engines.cost_curve import CostCurve, Variant, load_cost_curve

#: The cost curve the simulated device follows unless told otherwise: the GPU check's grid on
#: one H200 (2026-11-26, bert-base-sized, PyTorch fp16; docs/benchmarks.md).
DEFAULT_CURVE = Path(__file__).resolve().parent / "data" / "cost_curve_h200.json"
#: The device file: the device's total busy seconds, over every process that used it.
_LAYOUT = struct.Struct("d")
#: How far back the busy share looks.
BUSY_WINDOW_S = 10.0


@dataclass(frozen=True)
class SimSettings:
    """How the simulated device behaves: its cost curve (a file; None: DEFAULT_CURVE), its speed
    against the measured GPU (``scale``; 0: ``auto``), the host CPU per run (``launch_ms``), and
    the folder of its device files, which the processes that share a device share (server.py
    makes one per server; None: a folder of this process's own, removed at its exit)."""

    curve: str | None = None
    scale: float = 0.0
    launch_ms: float = 0.1
    directory: str | None = None


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
        self._burn = HostBurner()
        self._lock = threading.Lock()  # the samples: session, stats and /metrics threads
        self._closed = False
        self._samples: deque[tuple[float, float]] = deque(maxlen=256)
        self._samples.append((time.monotonic(), self.busy_s()))

    def device_ms(self, rows: int, length: int) -> float:
        """Device milliseconds one run of ``rows`` x ``length`` takes here (after the scale)."""
        grid_rows, grid_lengths = self.curve.data["rows"], self.curve.data["lengths"]
        fit_rows, fit_length = min(rows, grid_rows[-1]), min(length, grid_lengths[-1])
        cell = self.curve.lookup(self.variant, fit_rows, fit_length)
        beyond = (rows / fit_rows) * (length / fit_length)  # past the grid: by tokens
        below = max((r for r in grid_rows if r < fit_rows), default=None)
        if self.max_tokens and cell.rows * cell.length > self.max_tokens and \
                below is not None and fit_rows not in grid_rows:  # no graph: its own rows
            low = self.curve.lookup(self.variant, below, fit_length).wall_ms_median
            share = (fit_rows - below) / (cell.rows - below)
            return (low + share * (cell.wall_ms_median - low)) * beyond / self.scale
        return cell.wall_ms_median * beyond / self.scale

    def launch(self) -> None:
        """Spend the host CPU of one run's launch on this thread, with the GIL released."""
        self._burn.burn(self.settings.launch_ms / 1e3)

    def run(self, rows: int, length: int) -> float:
        """Wait for the device, then keep it busy for one run's device time; returns that time
        in seconds (what CUDA events would give)."""
        seconds = self.device_ms(rows, length) / 1e3
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            time.sleep(seconds)
            (busy,) = _LAYOUT.unpack_from(self._map, 0)
            _LAYOUT.pack_into(self._map, 0, busy + seconds)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        now = time.monotonic()
        with self._lock:
            if now - self._samples[-1][0] >= 0.1:
                self._samples.append((now, self.busy_s()))
        return seconds

    def busy_s(self) -> float:
        """The device's total busy seconds, over every process that uses it."""
        return float(_LAYOUT.unpack_from(self._map, 0)[0])

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
        return (f"simulated device {self.index} at {self.scale:.3g} x {self.variant.label()} "
                f"({gpu}), launch {self.settings.launch_ms:g} ms host CPU per run")

    def close(self) -> None:
        """Let go of the device file (it stays for the other processes)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._map.close()
        os.close(self._fd)


class HostBurner:
    """Burns host CPU for a given time on the calling thread without holding the GIL: hashing
    a buffer, which CPython does with the GIL released, sized by a rate measured once."""

    _BUFFER = bytes(1 << 20)
    _rate: float | None = None  # bytes hashed per second, measured once per process
    _lock = threading.Lock()

    def burn(self, seconds: float) -> None:
        """Hash about ``seconds`` worth of bytes."""
        if seconds <= 0:
            return
        left = int(self.rate() * seconds)
        view = memoryview(self._BUFFER)
        while left > 0:
            hashlib.sha1(view[:min(left, len(view))]).digest()
            left -= len(view)

    @classmethod
    def rate(cls) -> float:
        """Bytes per second this machine hashes (the best of five timings of the buffer)."""
        with cls._lock:
            if cls._rate is None:
                best = min(_time_hash(cls._BUFFER) for _ in range(5))
                cls._rate = len(cls._BUFFER) / max(best, 1e-6)
            return cls._rate


def _time_hash(buffer: bytes) -> float:
    started = time.perf_counter()
    hashlib.sha1(buffer).digest()
    return time.perf_counter() - started


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
    """The device file (its folder too), created with zero busy seconds by whoever comes
    first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        if os.fstat(fd).st_size < _LAYOUT.size:
            os.ftruncate(fd, _LAYOUT.size)
            os.pwrite(fd, _LAYOUT.pack(0.0), 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    return fd, mmap.mmap(fd, _LAYOUT.size)
