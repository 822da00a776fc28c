"""The host parts of one CUDA-graph run, timed one by one (engines/sim_host.py's ``PARTS``), for
the GPU check's engine grid (bench/engine_grid.py writes them as a cell's ``host_ms``).

Each part is the median over ``runs`` of the host's wall time for that step alone, run as the
overlapping launch (engines/torch_overlap.py) runs it, in one of its slots:

- ``pad``: the batch padded into the slot's host input buffer;
- ``copy_in``: that buffer copied to the device and into the graph's static input, waited for;
- ``launch``: the graph's replay call alone (it returns before the device is done);
- ``copy_out``: the outputs copied back to the slot's host buffer, waited for (after the replay
  has finished, so that it is the copy alone);
- ``unpack``: that buffer cut to the batch and made numpy arrays.

The device's own time is what remains of the run's wall time (engines/sim_host.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from engines.shapes import pad_into, pick_shape


def _timed(step: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Host ms of ``step`` and the wait ``sync`` after it."""
    began = time.perf_counter()
    step()
    sync()
    return 1e3 * (time.perf_counter() - began)


def host_parts_ms(engine: Any, feeds: Mapping[str, np.ndarray], runs: int) -> dict[str, float]:
    """Each host part's median ms for ``feeds`` on ``engine`` (a PyTorch engine with CUDA
    graphs); empty where the engine has none or no captured shape holds the batch."""
    launcher = getattr(engine, "_launcher", None)
    stacked = np.stack([np.asarray(feeds[name], dtype=np.int64) for name in engine.input_names])
    _, rows, length = stacked.shape
    shape = pick_shape(launcher.shapes, rows, length) if launcher is not None else None
    if shape is None:
        return {}
    import torch  # the engine has it loaded already

    cuda = launcher.device.type == "cuda"
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(launcher.device)) if cuda \
        else (lambda: None)
    slot, replay = launcher.slots[0], launcher.replays[shape]
    host, out = slot.host[shape], slot.out[shape]
    staged = slot.staged.get(shape, replay.static_input)
    per_token = launcher.per_token
    times: dict[str, list[float]] = {"pad": [], "copy_in": [], "launch": [], "copy_out": [],
                                     "unpack": []}
    with torch.inference_mode():
        for _ in range(runs):
            times["pad"].append(_timed(lambda: pad_into(host.numpy(), stacked), sync))
            times["copy_in"].append(_timed(lambda: (staged.copy_(host, non_blocking=True),
                                                    replay.static_input.copy_(staged)), sync))
            times["launch"].append(_timed(replay.replay, lambda: None))
            sync()  # the replay done: the copy out is timed alone
            times["copy_out"].append(_timed(lambda: out.copy_(replay.static_output,
                                                              non_blocking=True), sync))
            cut = (lambda: out[:, :rows, :length].numpy().copy()) if per_token else \
                (lambda: out[:, :rows].numpy().copy())
            times["unpack"].append(_timed(cut, lambda: None))
    return {part: round(statistics.median(values), 4) for part, values in times.items()}
