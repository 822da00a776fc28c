"""How many worker processes each model gets under ``--workers N``: N each, where the machine's
memory (a container's limit, or what the system has available) holds them; fewer, and said,
where it does not.

Each worker process holds one model: the interpreter, the runtime and the tokenizer
(``PROCESS_BASE_MB``, measured for MiniLM on ONNX Runtime: docs/operations.md) and one copy of
the weights (the model file's size), whatever its number of sessions.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

#: What a worker process holds beside its model's weights, MB: the interpreter, numpy,
#: onnxruntime, the tokenizer and a serving process's heap (measured with a 86 MB MiniLM on
#: ONNX Runtime: 180 MB a worker when ready, about 200 after a load; docs/operations.md).
PROCESS_BASE_MB = 105.0
#: A model's weights in memory against its file's size (the runtime's copy and its packing).
WEIGHTS_FACTOR = 1.1
#: The share of the available memory the workers may take (the rest: batches' working memory,
#: the front end, the page cache).
BUDGET_SHARE = 0.7


class WorkerPlan(NamedTuple):
    """Worker processes per model, and the reason, in words for the start-up log."""

    workers: int
    why: str


def worker_mb(weights_mb: float) -> float:
    """What one worker process of a model whose weights file is ``weights_mb`` holds."""
    return PROCESS_BASE_MB + WEIGHTS_FACTOR * weights_mb


def plan_workers(asked: int, weights_mb: list[float], available_mb: float | None) -> WorkerPlan:
    """Worker processes per model: ``asked``, or as many as ``BUDGET_SHARE`` of
    ``available_mb`` holds for every model (at least one each)."""
    each = sum(worker_mb(size) for size in weights_mb)
    total = asked * each
    models = len(weights_mb)
    if available_mb is None:
        return WorkerPlan(asked, f"{asked * models} worker processes, about {total:.0f} MB")
    fits = max(1, int(BUDGET_SHARE * available_mb // each)) if each else asked
    if fits >= asked:
        return WorkerPlan(asked, f"{asked * models} worker processes, about {total:.0f} MB of "
                                 f"{available_mb:.0f} MB available")
    return WorkerPlan(fits, f"{fits} worker(s) per model, not {asked}: {asked * models} "
                            f"processes would take about {total:.0f} MB of {available_mb:.0f} MB "
                            "available")


def available_mb() -> float | None:
    """Memory the server may use, MB: what the system has available, or less where a
    container's limit (cgroup v2's memory.max, v1's limit) leaves less; None where unknown."""
    found = [mb for mb in (_meminfo_available(), _cgroup_room()) if mb is not None]
    return min(found) if found else None


def _meminfo_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> float | None:
    """The cgroup's limit less what it uses now, MB; None without a limit."""
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                         "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = Path(limit).read_text().strip()
            if cap == "max" or int(cap) >= 2**60:
                return None
            return (int(cap) - int(Path(used).read_text().strip())) / 2**20
        except (OSError, ValueError):
            continue
    return None
