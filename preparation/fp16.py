"""An fp16 copy of a prepared model's ONNX export, checked against the fp32 one.

``export_fp16`` fuses the graph with ONNX Runtime's transformer optimizer (attention, layer norm,
GELU, embeddings: the fusions that need no GPU to find), converts the weights and arithmetic to
float16 with float32 inputs and outputs, and writes ``model_fp16.onnx`` beside ``model.onnx``.
It then serves both through the folder's task on the evaluation cases (the request mix shipped
in bench/data, else a few built-in pairs) and records in serving.json how often the answers
agree, the largest output difference, and where it checked. A QA answer agrees when its text,
start and end are the same; an embedding when its cosine similarity to fp32's is at least
``MIN_EMBED_COSINE``; a classification when its label is the same. The text tasks take each
question and each context of the cases as one text. On a GPU machine the check runs on CUDA, in
float16 arithmetic. On the CPU it still runs, but ONNX Runtime's CPU provider computes most of
the fused float16 operators in float32 between casts, so there it checks the rounding of the
weights more than float16 arithmetic.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import TASK_OUTPUT_NAMES
from engines.model_dir import ModelInfo, load_model_info, save_model_info
from protocol.errors import EngineError

log = logging.getLogger(__name__)

FP16_FILE = "model_fp16.onnx"
#: Share of evaluation answers the fp16 model must give exactly as the fp32 one.
MIN_AGREEMENT = 0.99
#: Least cosine similarity between an fp16 embedding and the fp32 one for them to agree.
MIN_EMBED_COSINE = 0.999
EVALUATION_FILE = Path(__file__).resolve().parent.parent / "bench" / "data" / "qa_pairs.jsonl"
_BUILT_IN_CASES = [
    ("Who wrote the report?", "The report was written by Ada Lovelace in 1843."),
    ("Where is it?", "It sits on a shelf in the old library, next to the window, under a lamp."),
    ("When does the van come?", "The mobile library van visits eighteen villages every "
     "fortnight; it comes to ours on Tuesday mornings and stays until noon."),
]


class Fp16ParityError(ValueError):
    """The fp16 model's answers agree with the fp32 model's too rarely to serve it."""


def evaluation_cases(path: Path = EVALUATION_FILE) -> list[tuple[str, str]]:
    """The (question, context) pairs the fp16 model is checked on."""
    if not path.is_file():
        return list(_BUILT_IN_CASES)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [(row["question"], row["context"]) for row in rows]


def export_fp16(model_dir: str | Path, min_agreement: float = MIN_AGREEMENT,
                cases: list[tuple[str, str]] | None = None) -> ModelInfo:
    """Write ``model_fp16.onnx`` into a prepared folder, check it, and record it in serving.json.

    Raises:
        Fp16ParityError: fewer than ``min_agreement`` of the answers agree (the fp16 file is
            removed again and serving.json is left as it was).
        ValueError: the folder's task is not built in (nothing to check a plug-in's answers
            with).
    """
    folder = Path(model_dir)
    info = load_model_info(folder)
    if info.task not in TASK_OUTPUT_NAMES:
        raise ValueError(f"--fp16 checks the built-in tasks {sorted(TASK_OUTPUT_NAMES)}, not "
                         f"{info.task!r}")
    _convert(folder / info.onnx_file, folder / FP16_FILE)
    try:
        parity = check_parity(folder, info, cases if cases is not None else evaluation_cases())
    except BaseException:  # an unchecked fp16 file must not stay beside the model
        (folder / FP16_FILE).unlink(missing_ok=True)
        raise
    log.info("fp16 vs fp32: %d of %d answers agree (%.1f%%); largest output difference %.3g",
             parity["agreeing"], parity["cases"], 100 * parity["agreement"],
             parity["max_abs_logit_diff"])
    if parity["agreement"] < min_agreement:
        (folder / FP16_FILE).unlink()
        raise Fp16ParityError(f"fp16 answers agree with fp32 on {100 * parity['agreement']:.1f}% "
                              f"of {parity['cases']} cases, below {100 * min_agreement:.0f}%; "
                              f"{FP16_FILE} not kept")
    info.fp16 = {"file": FP16_FILE, **parity}
    save_model_info(folder, info)
    return info


def attention_shape(folder: Path) -> tuple[int, int]:
    """(attention heads, hidden size) from the folder's config.json (BERT's names, or
    DistilBERT's); (0, 0), which the optimizer reads as "find them in the graph", where it has
    none. A transformers 5 export reshapes to ``-1`` heads, where the optimizer cannot find them."""
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    heads = config.get("num_attention_heads", config.get("n_heads", 0))
    hidden = config.get("hidden_size", config.get("dim", 0))
    return (int(heads), int(hidden)) if heads and hidden else (0, 0)


def _convert(source: Path, target: Path) -> None:
    """Fuse and convert ``source`` to float16 (float32 inputs and outputs kept)."""
    from onnxruntime.transformers import optimizer

    heads, hidden = attention_shape(source.parent)
    model = optimizer.optimize_model(str(source), model_type="bert", num_heads=heads,
                                     hidden_size=hidden, opt_level=0, use_gpu=False)
    log.info("fused operators: %s",
             {k: v for k, v in model.get_fused_operator_statistics().items() if v})
    model.convert_float_to_float16(keep_io_types=True)
    model.save_model_to_file(str(target))


def check_parity(folder: Path, info: ModelInfo, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Answers of the fp32 and fp16 exports on ``cases`` (on CUDA where there is one, else the
    CPU): how many agree, and the largest output difference (over real tokens for QA)."""
    import onnxruntime as ort

    from engines.onnx_providers import CUDA_PROVIDER, choose_providers, open_session

    providers = choose_providers("auto", tensorrt=False)  # CUDA where there is one, else CPU
    sessions = [open_session(folder / name, ort.SessionOptions(), providers, "auto")[0]
                for name in (info.onnx_file, FP16_FILE)]
    names = list(info.output_names)

    def run(feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [dict(zip(names, s.run(names, feeds), strict=True)) for s in sessions]

    agreeing, largest, count = compare_answers(folder, info, cases, run)
    checked_on = "cuda" if CUDA_PROVIDER in sessions[1].get_providers() else "cpu"
    return {"cases": count, "agreeing": agreeing, "checked_on": checked_on,
            "agreement": agreeing / max(1, count), "max_abs_logit_diff": largest}


#: Runs one batch's feeds on the reference model and on the one checked: [reference, checked].
Runner = Callable[[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]


def compare_answers(folder: Path, info: ModelInfo, cases: list[tuple[str, str]],
                    run: Runner) -> tuple[int, float, int]:
    """(answers that agree, largest output difference, cases checked) of the folder's task on
    ``cases``, each run through ``run``: the reference's answer against the checked one's."""
    compare = _qa_compare if info.task == "qa" else _text_compare
    return compare(folder, info, cases, run)


def _qa_compare(folder: Path, info: ModelInfo, cases: list[tuple[str, str]],
                run: Runner) -> tuple[int, float, int]:
    """(answers that agree, largest logit difference over real tokens, cases) for QA."""
    from tasks.qa import QAConfig, QATask

    longest = min(QAConfig().max_seq_len, info.max_seq_len)  # windows the model takes
    config = QAConfig(max_seq_len=longest, doc_stride=min(QAConfig().doc_stride, longest // 3))
    task = QATask.from_dir(folder, config, input_names=info.input_names)
    agreeing, largest = 0, 0.0
    for question, context in cases:
        features = task.preprocess(question, context)
        feeds = task.collate([features])
        full, half = run(feeds)
        real = feeds["attention_mask"].astype(bool)
        largest = max(largest, *(_difference(full[n][real], half[n][real])
                                 for n in info.output_names))
        expected = task.answer_batch([features], full)[0]
        try:
            answer = task.answer_batch([features], half)[0]
        except EngineError:  # fp16 overflowed to NaN or infinity: a disagreement, not a crash
            continue
        agreeing += all(expected[key] == answer[key] for key in ("answer", "start", "end"))
    return agreeing, largest, len(cases)


def _text_compare(folder: Path, info: ModelInfo, cases: list[tuple[str, str]],
                  run: Runner) -> tuple[int, float, int]:
    """(answers that agree, largest output difference, texts) for embed and classify: every
    question and every context of ``cases`` is one text."""
    from tasks.rows import stack_rows
    from tasks.text import TextEncoder

    encoder = TextEncoder.from_dir(folder, info.max_seq_len)
    texts = [text for pair in cases for text in pair]
    agreeing, largest = 0, 0.0
    for text in texts:
        features = encoder.encode([text])
        feeds = stack_rows([features], info.input_names, encoder.pad_id, features.max_len)
        full, half = run(feeds)
        largest = max(largest, *(_difference(full[n], half[n]) for n in info.output_names))
        agreeing += _agree(info.task, full[info.output_names[0]][0],
                           half[info.output_names[0]][0])
    return agreeing, largest, len(texts)


def _agree(task: str, full: np.ndarray, half: np.ndarray) -> bool:
    """Whether one text's fp16 output agrees with fp32's (cosine for embed, label else); never
    where fp16's holds NaN or an infinity."""
    if not np.isfinite(half).all():
        return False
    if task == "embed":
        cosine = float(np.dot(full, half) / (np.linalg.norm(full) * np.linalg.norm(half)))
        return cosine >= MIN_EMBED_COSINE
    return int(np.argmax(full)) == int(np.argmax(half))


def _difference(full: np.ndarray, half: np.ndarray) -> float:
    """The largest absolute difference, or infinity where fp16's output is not finite (NaN
    would otherwise vanish from a running maximum)."""
    difference = np.abs(full - half)
    return float(difference.max()) if np.isfinite(difference).all() else math.inf
