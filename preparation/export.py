"""Save a PyTorch model as a servable folder: weights, tokenizer, ONNX export, metadata.

One function per step, each taking the task (``qa``, ``embed`` or ``classify``; engines/
task_models.py says what each task's model returns). Used by prepare_model.py and by the tests
(which build tiny random models), so both go through the same code. Heavy imports (torch,
onnxruntime) happen here only.

The ONNX graph's attention must keep the shape that ONNX Runtime's transformer optimizer fuses
(preparation/fp16.py: its fused Attention and EmbedLayerNormalization operators). Models of
transformers 5 build their attention mask in a way it no longer recognises, so where a model
takes a prepared mask (transformers 5 does, 4.57 does not) and gives the same outputs with it,
the export runs eager attention on the additive 4D mask transformers 4 built (``fusable_outputs``).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engines.base import TASK_OUTPUT_NAMES
from engines.model_dir import ONNX_FILE, ModelInfo, save_model_info
from engines.task_models import TaskOutputs

log = logging.getLogger(__name__)

#: Largest |ONNX - PyTorch| output difference accepted by verify_onnx.
DEFAULT_TOLERANCE = 1e-3
#: The longest QA window a folder offers by default (the pipeline's max_seq_len).
QA_MAX_SEQ_LEN = 384

_SAMPLE_PAIRS = [
    ("Who wrote the report?", "The report was written by Ada Lovelace in 1843."),
    ("Where is it?", "It sits on a shelf in the old library, next to the window, under a lamp."),
    ("¿Qué hora es?", "Son las tres y media de la tarde en Zúrich."),
]
_SAMPLE_TEXTS = [
    "A short one.",
    "It sits on a shelf in the old library, next to the window, under a lamp that hums.",
    "Son las tres y media de la tarde en Zúrich.",
]


def model_input_names(model: torch.nn.Module, tokenizer: Any) -> list[str]:
    """The inputs both the tokenizer produces and the model's forward accepts, in a fixed order."""
    import inspect

    accepted = set(inspect.signature(model.forward).parameters)
    order = ["input_ids", "attention_mask", "token_type_ids"]
    produced = set(tokenizer.model_input_names) | {"attention_mask"}
    return [n for n in order if n in accepted and n in produced]


def sample_feeds(tokenizer: Any, input_names: list[str], task: str = "qa") -> dict[str, np.ndarray]:
    """A small padded batch of real inputs, as int64 numpy arrays: question/context pairs for
    ``qa``, single texts of different lengths for the other tasks."""
    if task == "qa":
        questions, contexts = zip(*_SAMPLE_PAIRS, strict=True)
        enc = tokenizer(list(questions), list(contexts), padding=True, return_tensors="np")
    else:
        enc = tokenizer(list(_SAMPLE_TEXTS), padding=True, return_tensors="np")
    return {name: enc[name].astype(np.int64) for name in input_names}


def output_axes(task: str) -> dict[str, dict[int, str]]:
    """The dynamic axes of a task's outputs: QA logits have a sequence axis, the others only
    rows."""
    if task == "qa":
        return {name: {0: "batch", 1: "sequence"} for name in TASK_OUTPUT_NAMES[task]}
    return {name: {0: "batch"} for name in TASK_OUTPUT_NAMES[task]}


def expanded_attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """The additive ``[rows, 1, length, length]`` float32 mask transformers 4 built from a 2D one:
    0 where a token may be attended, float32's lowest value where not."""
    rows, length = mask.shape
    expanded = mask[:, None, None, :].expand(rows, 1, length, length).to(torch.float32)
    inverted = 1.0 - expanded
    return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(torch.float32).min)


@contextmanager
def fusable_outputs(model: torch.nn.Module, task: str, input_names: list[str],
                    feeds: dict[str, np.ndarray]) -> Iterator[TaskOutputs]:
    """The task's outputs to export: eager attention on ``expanded_attention_mask`` where the
    model takes that mask and gives the same outputs on ``feeds`` as it does as loaded (within
    ``DEFAULT_TOLERANCE``); else the model as loaded. The model's attention implementation is
    restored on leaving."""
    plain = TaskOutputs(model, task, input_names).eval()
    switch = getattr(model, "set_attn_implementation", None)
    before = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if switch is None or before is None or "attention_mask" not in input_names:
        yield plain
        return
    expected = _outputs(plain, feeds)
    prepared = TaskOutputs(model, task, input_names, model_mask=expanded_attention_mask).eval()
    try:
        switch("eager")
        same = largest_difference(_outputs(prepared, feeds), expected, feeds,
                                  task) <= DEFAULT_TOLERANCE
    except Exception as exc:  # noqa: BLE001 - a model that refuses the mask is exported as is
        log.debug("exporting the model as loaded: a prepared mask fails (%s)", exc)
        same = False
    if not same:
        switch(before)
        yield plain
        return
    log.info("ONNX export: eager attention on an expanded mask (%s as loaded)", before)
    try:
        yield prepared
    finally:
        switch(before)


def export_onnx(model: torch.nn.Module, path: Path, input_names: list[str], opset: int,
                feeds: dict[str, np.ndarray], task: str = "qa") -> None:
    """Export ``task``'s outputs (engines/task_models.py; ``fusable_outputs``) with dynamic batch
    and sequence axes (TorchScript exporter, deterministic)."""
    args = tuple(torch.from_numpy(feeds[n]) for n in input_names)
    axes = {**{n: {0: "batch", 1: "sequence"} for n in input_names}, **output_axes(task)}
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad(), \
            fusable_outputs(model, task, input_names, feeds) as wrapper:
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper, args, str(path), input_names=input_names,
            output_names=list(TASK_OUTPUT_NAMES[task]), dynamic_axes=axes, opset_version=opset,
            do_constant_folding=True, dynamo=False,
        )


def _outputs(wrapper: TaskOutputs, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``wrapper``'s outputs on ``feeds``, as float32 numpy arrays."""
    with torch.inference_mode():
        out = wrapper.named({k: torch.from_numpy(v) for k, v in feeds.items()})
    return [value.float().numpy() for value in out]


def torch_outputs(model: torch.nn.Module, feeds: dict[str, np.ndarray],
                  task: str = "qa") -> list[np.ndarray]:
    """``task``'s outputs of the PyTorch model on ``feeds``, in ``TASK_OUTPUT_NAMES`` order."""
    return _outputs(TaskOutputs(model, task, list(feeds)).eval(), feeds)


def largest_difference(got: list[np.ndarray], expected: list[np.ndarray],
                       feeds: dict[str, np.ndarray], task: str = "qa") -> float:
    """Largest absolute difference between two runs' outputs on ``feeds``: for ``qa`` only at
    positions under the attention mask (padding logits are meaningless); the other tasks'
    outputs have one row per input row, all compared."""
    pairs = zip(got, expected, strict=True)
    if task == "qa":
        mask = feeds["attention_mask"].astype(bool)
        return float(max(np.abs(o - t)[mask].max() for o, t in pairs))
    return float(max(np.abs(o - t).max() for o, t in pairs))


def verify_onnx(model: torch.nn.Module, path: Path, feeds: dict[str, np.ndarray],
                task: str = "qa") -> float:
    """Largest absolute output difference (``largest_difference``) between ONNX Runtime (CPU)
    and PyTorch on ``feeds``."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    onnx_out = session.run(list(TASK_OUTPUT_NAMES[task]), feeds)
    return largest_difference(onnx_out, torch_outputs(model, feeds, task), feeds, task)


def task_metadata(model: torch.nn.Module, task: str,
                  feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """What serving.json records for ``task`` beside the common fields: ``labels`` of a
    classifier (its config's id2label, in logit order), ``embedding_dim`` of an embedder.

    Raises:
        ValueError: A task that is not built in.
    """
    if task not in TASK_OUTPUT_NAMES:
        raise ValueError(f"cannot export task {task!r}; built in: {sorted(TASK_OUTPUT_NAMES)}")
    extra: dict[str, Any] = {"task": task, "output_names": list(TASK_OUTPUT_NAMES[task])}
    if task == "classify":
        id2label = getattr(model.config, "id2label", None) or {}
        count = int(model.config.num_labels)
        extra["labels"] = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}")))
                           for i in range(count)]
    elif task == "embed":
        extra["embedding_dim"] = int(torch_outputs(model, feeds, task)[0].shape[1])
    return extra


def longest_input(model: torch.nn.Module, tokenizer: Any, task: str,
                  max_seq_len: int | None) -> int:
    """The most tokens per row the folder offers: ``max_seq_len`` when given, else what the
    tokenizer and the position embeddings allow (at most 384 for QA windows)."""
    if max_seq_len is not None:
        return max_seq_len
    longest = int(min(getattr(tokenizer, "model_max_length", 512) or 512,
                      getattr(model.config, "max_position_embeddings", 512)))
    return min(QA_MAX_SEQ_LEN, longest) if task == "qa" else longest


def export_model_dir(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, *,
                     model_name: str, source: str, task: str = "qa", meaningful: bool = True,
                     warning: str | None = None, squad2: bool = False, opset: int = 17,
                     tolerance: float = DEFAULT_TOLERANCE,
                     max_seq_len: int | None = None) -> ModelInfo:
    """Write a complete servable folder and return its metadata.

    Args:
        model: For ``qa`` a QA model, for ``embed`` an encoder (``AutoModel``; the export adds
            mean pooling and L2 normalisation), for ``classify`` a sequence classifier.
        task: ``qa``, ``embed`` or ``classify``.
        squad2: QA only: "no answer" is on by default when serving it.
        max_seq_len: The longest row the task may make (e.g. a sentence-transformers model's
            ``max_seq_length``); None: see ``longest_input``.

    Raises:
        ValueError: an unknown task, or the ONNX export disagrees with PyTorch by more than
            ``tolerance``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.eval().to("cpu")
    names = model_input_names(model, tokenizer)
    feeds = sample_feeds(tokenizer, names, task)
    extra = task_metadata(model, task, feeds)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    _readable_as_umask_allows(out / "model.safetensors")
    export_onnx(model, out / ONNX_FILE, names, opset, feeds, task)
    diff = verify_onnx(model, out / ONNX_FILE, feeds, task)
    log.info("ONNX vs PyTorch: largest %s difference %.2e (tolerance %.0e)",
             "logit" if task != "embed" else "embedding", diff, tolerance)
    if not diff <= tolerance:
        raise ValueError(f"ONNX export differs from PyTorch by {diff:.3e} > {tolerance:.0e}")
    info = ModelInfo(
        model_name=model_name, source=source, input_names=names, meaningful=meaningful,
        warning=warning, squad2=squad2 and task == "qa",
        max_seq_len=longest_input(model, tokenizer, task, max_seq_len), onnx_opset=opset,
        onnx_max_abs_diff=diff, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
    )
    save_model_info(out, info)
    return info


def _readable_as_umask_allows(path: Path) -> None:
    """Give ``path`` the mode a new file gets under the umask (safetensors writes 0600, which
    a server running as another user cannot read for the PyTorch engine)."""
    if path.is_file():
        umask = os.umask(0)
        os.umask(umask)
        path.chmod(0o666 & ~umask)
