"""The process layout ``python server.py`` chooses where its flags do not say: on a GPU box, one
executor per GPU and worker processes for the rest of the cores; on a CPU-only machine, one
process. The choice and the reason go to the start-up log.

Measured (docs/benchmarks.md): on one H100 with 16 cores, 4 workers and one executor served
3,620 requests/s against 1,033 for one process, with one CUDA context (4 workers owning an
engine each: 3,540 with four contexts and 5x the GPU memory); on the simulated GPU of a 2-core
machine, 2 workers and an executor keep the device busiest. On the CPU alone one process serves
the most: worker processes pay off only with cores to spare beyond the engine's own threads.

``--workers`` or ``--executors`` given, a ``--broker`` layout, or ``--role worker``: the flags
say, and nothing is chosen.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import NamedTuple

from engines.devices import usable_gpus, visible_gpus
from settings.server_config import ServerConfig

#: Engine types that run on a GPU (the sim engine on a simulated one).
GPU_ENGINES = frozenset({"pytorch", "onnx", "sim"})
#: Cores per worker process beside the executors: 4 workers on 16 cores, as measured.
CORES_PER_WORKER = 4
#: Worker processes at least and at most.
MIN_WORKERS, MAX_WORKERS = 2, 8
#: Sessions per worker with executors (each a connection waiting on its executor: more keep
#: more of the workers' rows before the executor; 4 served more than 2 on the H100 and sim).
EXECUTOR_SESSIONS = 4


def chosen_gpus(config: ServerConfig, given: set[str], engine: str, found: int) -> list[int]:
    """The GPUs to serve on: ``--cuda_devices``; else the one ``--device cuda:N`` names; else
    every GPU there is (the sim engine: one simulated device)."""
    if config.gpu_indices():
        return config.gpu_indices()
    _, _, index = config.device.partition(":")
    if "device" in given and index.isdigit():
        return [int(index)]
    return [0] if engine == "sim" else list(range(found))


class Layout(NamedTuple):
    """The settings to serve with, and why, in words for the start-up log."""

    config: ServerConfig
    why: str


def choose_layout(config: ServerConfig, given: set[str], cores: int | None = None,
                  gpus: int | None = None) -> Layout:
    """The layout for ``config`` where the flags in ``given`` (settings' names) leave it open.

    Args:
        cores: The machine's cores (default: this process's CPUs).
        gpus: GPUs the engine type can use (default: asked, ``usable_gpus``).
    """
    if config.role == "worker" or config.broker is not None:
        return Layout(config, "as the flags say (--broker: each front end and worker its own)")
    if given & {"workers", "executors"}:
        return Layout(config, "as the flags say (--workers, --executors)")
    engine = config.inference_engine_type
    on_cpu = "one process, which serves the most on the CPU (--workers N for more)"
    if engine not in GPU_ENGINES or config.device == "cpu":
        return Layout(config, on_cpu)
    found, why_none = (gpus, "") if gpus is not None else usable_gpus(engine)
    if not found:
        if gpus is None and visible_gpus() == 0 and config.device == "auto":
            return Layout(config, f"{on_cpu}; no GPU here")  # nothing to say of GPU runtimes
        return Layout(config, f"one process on the CPU: no GPU for the {engine} engine"
                              + (f" ({why_none})" if why_none else ""))
    indices = chosen_gpus(config, given, engine, found)
    cores = cores or len(os.sched_getaffinity(0))
    workers = max(len(indices), min(MAX_WORKERS, max(MIN_WORKERS, cores // CORES_PER_WORKER)))
    sessions = config.num_inference_sessions if "num_inference_sessions" in given \
        else EXECUTOR_SESSIONS
    chosen = replace(config, workers=workers, executors="on", num_inference_sessions=sessions,
                     cuda_devices=",".join(map(str, indices)))
    kind = "simulated GPU" if engine == "sim" else "GPU"
    return Layout(chosen, f"one executor per {kind} ({', '.join(f'cuda:{i}' for i in indices)}) "
                          f"and {workers} worker processes of {sessions} sessions for the "
                          f"{cores} cores, as a GPU box serves the most (docs/benchmarks.md); "
                          "--workers N, --executors on|off or --cuda_devices to choose")
