"""Save a PyTorch QA model as a servable folder: weights, tokenizer, ONNX export, metadata.

Used by prepare_model.py and by the tests (which build tiny random models), so both go through the
same code. Heavy imports (torch, onnxruntime) happen here only.
"""

from __future__ import annotations

import logging
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engines.base import QA_OUTPUT_NAMES
from engines.model_dir import ONNX_FILE, ModelInfo, save_model_info

log = logging.getLogger(__name__)

#: Largest |ONNX - PyTorch| logit difference accepted by verify_onnx.
DEFAULT_TOLERANCE = 1e-3

_SAMPLE_PAIRS = [
    ("Who wrote the report?", "The report was written by Ada Lovelace in 1843."),
    ("Where is it?", "It sits on a shelf in the old library, next to the window, under a lamp."),
    ("¿Qué hora es?", "Son las tres y media de la tarde en Zúrich."),
]


class _QAOutputs(torch.nn.Module):
    """Wraps a HF QA model so it takes positional tensors and returns (start, end) logits."""

    def __init__(self, model: torch.nn.Module, input_names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(**dict(zip(self.input_names, tensors)), return_dict=True)
        return out.start_logits, out.end_logits


def model_input_names(model: torch.nn.Module, tokenizer: Any) -> list[str]:
    """The inputs both the tokenizer produces and the model's forward accepts, in a fixed order."""
    import inspect

    accepted = set(inspect.signature(model.forward).parameters)
    order = ["input_ids", "attention_mask", "token_type_ids"]
    produced = set(tokenizer.model_input_names) | {"attention_mask"}
    return [n for n in order if n in accepted and n in produced]


def sample_feeds(tokenizer: Any, input_names: list[str]) -> dict[str, np.ndarray]:
    """A small padded batch of real question/context pairs, as int64 numpy arrays."""
    questions, contexts = zip(*_SAMPLE_PAIRS)
    enc = tokenizer(list(questions), list(contexts), padding=True, return_tensors="np")
    return {name: enc[name].astype(np.int64) for name in input_names}


def export_onnx(model: torch.nn.Module, path: Path, input_names: list[str], opset: int,
                feeds: dict[str, np.ndarray]) -> None:
    """Export with dynamic batch and sequence axes (TorchScript exporter, deterministic)."""
    wrapper = _QAOutputs(model, input_names).eval()
    args = tuple(torch.from_numpy(feeds[n]) for n in input_names)
    axes = {n: {0: "batch", 1: "sequence"} for n in [*input_names, *QA_OUTPUT_NAMES]}
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper, args, str(path), input_names=input_names, output_names=list(QA_OUTPUT_NAMES),
            dynamic_axes=axes, opset_version=opset, do_constant_folding=True, dynamo=False,
        )


def verify_onnx(model: torch.nn.Module, path: Path, feeds: dict[str, np.ndarray]) -> float:
    """Largest absolute logit difference between ONNX Runtime (CPU) and PyTorch on ``feeds``.

    Only positions under the attention mask are compared (padding logits are meaningless).
    """
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    onnx_out = session.run(list(QA_OUTPUT_NAMES), feeds)
    with torch.inference_mode():
        out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}, return_dict=True)
    torch_out = [out.start_logits.numpy(), out.end_logits.numpy()]
    mask = feeds["attention_mask"].astype(bool)
    return float(max(np.abs(o - t)[mask].max() for o, t in zip(onnx_out, torch_out)))


def export_model_dir(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, *,
                     model_name: str, source: str, meaningful: bool = True,
                     warning: str | None = None, squad2: bool = False, opset: int = 17,
                     tolerance: float = DEFAULT_TOLERANCE) -> ModelInfo:
    """Write a complete servable folder and return its metadata.

    Raises:
        ValueError: the ONNX export disagrees with PyTorch by more than ``tolerance``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.eval().to("cpu")
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    names = model_input_names(model, tokenizer)
    feeds = sample_feeds(tokenizer, names)
    export_onnx(model, out / ONNX_FILE, names, opset, feeds)
    diff = verify_onnx(model, out / ONNX_FILE, feeds)
    log.info("ONNX vs PyTorch: largest logit difference %.2e (tolerance %.0e)", diff, tolerance)
    if not diff <= tolerance:
        raise ValueError(f"ONNX export differs from PyTorch by {diff:.3e} > {tolerance:.0e}")
    max_len = int(min(getattr(tokenizer, "model_max_length", 512) or 512,
                      getattr(model.config, "max_position_embeddings", 512)))
    info = ModelInfo(
        model_name=model_name, source=source, input_names=names, meaningful=meaningful,
        warning=warning, squad2=squad2, max_seq_len=min(384, max_len), onnx_opset=opset,
        onnx_max_abs_diff=diff, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    save_model_info(out, info)
    return info
