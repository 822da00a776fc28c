"""PyTorch float16 on CUDA checked against float32 on the same device, recorded in serving.json
(``torch_fp16``).

On a GPU box ``python server.py`` serves PyTorch fp16 unless told otherwise
(workers/engine_choice.py); where this check found fp16's answers disagreeing with fp32's beyond
the threshold, it serves fp32 there instead and says why. prepare_model.py runs the check where
torch sees a CUDA device. Answers are compared as the ONNX fp16 export's are
(preparation/fp16.py: the same evaluation cases, the same notion of agreement). The check takes
its device and precision, so that it runs on the CPU too, in bfloat16, as the tests run it;
float16 needs CUDA.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import TASK_OUTPUT_NAMES
from engines.model_dir import ModelInfo, load_model_info, save_model_info
from preparation.fp16 import MIN_AGREEMENT, compare_answers, evaluation_cases

log = logging.getLogger(__name__)


def check_torch_precision(folder: Path, info: ModelInfo, cases: list[tuple[str, str]], *,
                          device: str = "cuda", precision: str = "fp16") -> dict[str, Any]:
    """The folder's PyTorch model at ``precision`` against fp32, both on ``device`` and run
    eager, on ``cases``: how many answers agree, and the largest output difference.

    Raises:
        ValueError: ``device`` cannot run ``precision`` (float16 on the CPU, say).
    """
    from engines.torch_engine import TorchEngine

    engines = [TorchEngine(folder, device=device, precision=p, graph="eager")
               for p in ("fp32", precision)]
    if engines[1].precision != precision:
        raise ValueError(f"PyTorch cannot run {precision} on {engines[1].device}")

    def run(feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [engine.run(feeds) for engine in engines]

    agreeing, largest, count = compare_answers(folder, info, cases, run)
    return {"precision": precision, "checked_on": engines[1].device, "cases": count,
            "agreeing": agreeing, "agreement": agreeing / max(1, count),
            "max_abs_logit_diff": largest}


def record_torch_check(model_dir: str | Path, min_agreement: float = MIN_AGREEMENT,
                       cases: list[tuple[str, str]] | None = None, *, device: str = "cuda",
                       precision: str = "fp16") -> ModelInfo:
    """Check a prepared folder's PyTorch model at ``precision`` against fp32 and record it in
    serving.json as ``torch_fp16``, with ``agrees``: whether at least ``min_agreement`` of the
    answers agree.

    Raises:
        ValueError: the folder's task is not built in, or ``device`` cannot run ``precision``.
    """
    folder = Path(model_dir)
    info = load_model_info(folder)
    if info.task not in TASK_OUTPUT_NAMES:
        raise ValueError(f"PyTorch serves the built-in tasks {sorted(TASK_OUTPUT_NAMES)}, not "
                         f"{info.task!r}")
    parity = check_torch_precision(folder, info, evaluation_cases() if cases is None else cases,
                                   device=device, precision=precision)
    agrees = parity["agreement"] >= min_agreement
    info.torch_fp16 = {**parity, "min_agreement": min_agreement, "agrees": agrees}
    save_model_info(folder, info)
    return info


def check_on_gpu(model_dir: Path, min_agreement: float) -> None:
    """prepare_model.py's step: where torch sees a CUDA device, check PyTorch fp16 there
    against fp32 and record it (and say it); elsewhere nothing."""
    import torch

    if not torch.cuda.is_available():
        return
    log.info("checking PyTorch fp16 on CUDA against fp32 (what server.py serves on a GPU)...")
    try:
        parity = record_torch_check(model_dir, min_agreement).torch_fp16 or {}
    except (RuntimeError, ValueError) as exc:  # the model is prepared all the same
        log.warning("PyTorch fp16 could not be checked (%s: %s); nothing recorded",
                    type(exc).__name__, exc)
        return
    said = (f"PyTorch fp16 on {parity['checked_on']}: {parity['agreeing']} of "
            f"{parity['cases']} answers as fp32's, largest output difference "
            f"{parity['max_abs_logit_diff']:.3g}")
    if parity["agrees"]:
        print(said, flush=True)
    else:
        log.warning("%s, below %.0f%%: server.py serves it in fp32 on a GPU unless --precision "
                    "says otherwise", said, 100 * min_agreement)
