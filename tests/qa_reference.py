"""transformers 4.57's ``pipeline("question-answering")``, stored for the lines that have none.

transformers 5 removed the QA pipeline that our answers are checked against
(tests/test_qa_agreement.py, tests/test_engines.py). tests/data/qa_pipeline_reference.json
keeps, for every case those tests ask the pipeline, what the pipeline saw and what it said:

- the question and context;
- the windows it ran the model on: their lengths and a digest of their token ids;
- the start and end logits the model gave it there (float32, exact, base64);
- its answers without and with "no answer" (``handle_impossible_answer``).

A test tokenizes the same question and context with our QA task, checks that it makes the same
windows, and decodes the stored logits: it must give the stored answers. That holds whatever
weights the installed transformers would give the tiny models, since no model runs. ``weights``
(a digest of the model's state) names the model that gave the logits, for the one test that
runs a model and so needs the same weights (the served engines' answers).

The file is written with transformers 4.57 (which has the pipeline), from the repository root:

    HF_HUB_OFFLINE=1 python -m tests.test_qa_stored_answers --write
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REFERENCE = Path(__file__).parent / "data" / "qa_pipeline_reference.json"
#: The answer keys of a case: without and with "no answer".
ANSWER_KEYS = {False: "squad1", True: "squad2"}
#: What a stored batch puts past each window's end: a logit that would win were it read.
PAST_THE_END = 1e4


def has_qa_pipeline() -> bool:
    """Whether the installed transformers offers ``pipeline("question-answering")``."""
    from transformers.pipelines import SUPPORTED_TASKS

    return "question-answering" in SUPPORTED_TASKS


@dataclass(frozen=True, kw_only=True)
class Case:
    """One question the pipeline answered: what it saw (windows, logits) and what it said."""

    question: str
    context: str
    lengths: list[int]
    windows: str
    start_logits: np.ndarray
    end_logits: np.ndarray
    answers: dict[str, dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        """The case as the file stores it."""
        return {"question": self.question, "context": self.context, "lengths": self.lengths,
                "windows": self.windows, "start_logits": _encode(self.start_logits),
                "end_logits": _encode(self.end_logits), "answers": self.answers}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Case:
        """A case read back from the file."""
        return cls(question=data["question"], context=data["context"],
                   lengths=list(data["lengths"]), windows=data["windows"],
                   start_logits=_decode(data["start_logits"]),
                   end_logits=_decode(data["end_logits"]), answers=data["answers"])


@dataclass(frozen=True, kw_only=True)
class Group:
    """Cases answered by one model under one window setting.

    Attributes:
        settings: ``max_seq_len`` and ``doc_stride`` given to both sides (empty: defaults).
        weights: ``weights_digest`` of the model that gave the logits.
    """

    settings: dict[str, Any]
    weights: str
    cases: list[Case]


def window_digest(ids: Sequence[Sequence[int]]) -> str:
    """A short hash of each window's token ids, in order."""
    joined = np.concatenate([np.asarray(window, dtype=np.int64) for window in ids])
    sizes = np.asarray([len(window) for window in ids], dtype=np.int64)
    return hashlib.sha256(sizes.tobytes() + joined.tobytes()).hexdigest()[:16]


def feature_windows(features: Any) -> list[list[int]]:
    """The token ids of each window of our task's features (``QAFeatures``), padding cut."""
    return [features.input_ids[row, :n].tolist() for row, n in enumerate(features.lengths)]


def weights_digest(model: Any) -> str:
    """A short hash of a PyTorch model's parameters and buffers, by name."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def record_group(model: Any, tokenizer: Any, cases: Sequence[tuple[str, str]],
                 settings: dict[str, int]) -> Group:
    """Ask the pipeline every case, without and with "no answer", and keep what its model saw
    and gave it (a forward hook on the model) with what it answered.

    Raises:
        AssertionError: the two runs of a case saw different windows or logits.
    """
    from transformers import pipeline

    reader = pipeline("question-answering", model=model, tokenizer=tokenizer)
    seen: list[tuple[list[int], np.ndarray, np.ndarray]] = []

    def keep(_module: Any, _args: Any, kwargs: dict[str, Any], output: Any) -> None:
        seen.append((kwargs["input_ids"][0].tolist(),
                     output.start_logits[0].detach().float().numpy(),
                     output.end_logits[0].detach().float().numpy()))

    hook = model.register_forward_hook(keep, with_kwargs=True)
    try:
        recorded = []
        for question, context in cases:
            runs, answers = [], {}
            for impossible, key in ANSWER_KEYS.items():
                seen.clear()
                said = reader(question=question, context=context,
                              handle_impossible_answer=impossible, **settings)
                answers[key] = {"answer": str(said["answer"]), "start": int(said["start"]),
                                "end": int(said["end"]), "score": float(said["score"])}
                runs.append(list(seen))
            recorded.append(_case(question, context, runs, answers))
    finally:
        hook.remove()
    return Group(settings=dict(settings), weights=weights_digest(model), cases=recorded)


def _case(question: str, context: str, runs: list[list[tuple[list[int], np.ndarray, np.ndarray]]],
          answers: dict[str, dict[str, Any]]) -> Case:
    """A case from the model calls of its runs (all alike) and the pipeline's answers."""
    first = runs[0]
    for other in runs[1:]:
        assert [w for w, _, _ in other] == [w for w, _, _ in first], "windows changed"
        assert all((a[1] == b[1]).all() and (a[2] == b[2]).all()
                   for a, b in zip(first, other, strict=True))
    return Case(question=question, context=context, lengths=[len(w) for w, _, _ in first],
                windows=window_digest([w for w, _, _ in first]),
                start_logits=np.concatenate([s for _, s, _ in first]),
                end_logits=np.concatenate([e for _, _, e in first]), answers=answers)


def stored_outputs(batch: Sequence[Any], cases: Sequence[Case]) -> dict[str, np.ndarray]:
    """The stored logits of ``cases`` laid out as an engine returns them for ``batch`` (our
    task's features of the same cases, collated): one row per window, ``PAST_THE_END`` past
    each window's length.

    Raises:
        ValueError: a case's windows are not the ones its features have.
    """
    width = max(features.max_len for features in batch)
    rows = sum(features.rows for features in batch)
    out = {name: np.full((rows, width), PAST_THE_END, dtype=np.float32)
           for name in ("start_logits", "end_logits")}
    row = 0
    for features, case in zip(batch, cases, strict=True):
        if features.lengths.tolist() != case.lengths:
            raise ValueError(f"windows of {features.lengths.tolist()} tokens, stored "
                             f"{case.lengths}: {case.question!r}")
        at = 0
        for n in case.lengths:
            out["start_logits"][row, :n] = case.start_logits[at:at + n]
            out["end_logits"][row, :n] = case.end_logits[at:at + n]
            row, at = row + 1, at + n
    return out


def load_reference(path: Path = REFERENCE) -> dict[str, Group]:
    """The stored groups, by name."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return {name: Group(settings=group["settings"], weights=group["weights"],
                        cases=[Case.from_json(case) for case in group["cases"]])
            for name, group in data["groups"].items()}


def write_reference(groups: dict[str, Group], recorded_with: dict[str, str],
                    path: Path = REFERENCE) -> None:
    """Write ``groups`` as the file, one case a line."""
    parts = []
    for name, group in groups.items():
        head = json.dumps({"settings": group.settings, "weights": group.weights})[:-1]
        cases = ",\n".join(json.dumps(case.to_json()) for case in group.cases)
        parts.append(f"{json.dumps(name)}: {head}, \"cases\": [\n{cases}\n]}}")
    path.parent.mkdir(exist_ok=True)
    path.write_text(f'{{"recorded_with": {json.dumps(recorded_with)},\n"groups": {{\n'
                    + ",\n".join(parts) + "\n}}\n", encoding="utf-8")


def _encode(values: np.ndarray) -> str:
    """float32 values as base64 of their little-endian bytes (exact)."""
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def _decode(text: str) -> np.ndarray:
    """The float32 values ``_encode`` wrote."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float32)
