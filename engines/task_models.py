"""What each built-in task's PyTorch model returns, shared by the ONNX export and the PyTorch
engine so that both compute the same thing.

- ``qa``: a ``...ForQuestionAnswering`` model; ``(start_logits, end_logits)``.
- ``embed``: an encoder (``AutoModel``) whose last hidden states are mean-pooled over the
  attention mask and L2-normalised (sentence-transformers' Pooling(mean) + Normalize);
  ``(embeddings,)``, ``[rows, hidden size]``.
- ``classify``: a ``...ForSequenceClassification`` model; ``(logits,)``, ``[rows, labels]``.

The model is given the 2D attention mask, as transformers runs it; the ONNX export may give it
one prepared from it instead (``TaskOutputs``' ``model_mask``; preparation/export.py says why).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engines.base import TASK_OUTPUT_NAMES


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean of each row's token vectors under its attention mask, in float32.

    Args:
        hidden: ``[rows, seq_len, dim]`` token vectors.
        attention_mask: ``[rows, seq_len]``, 1 for real tokens (special tokens included).

    Returns:
        ``[rows, dim]``; a row with no real token gives zeros.
    """
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1e-9)


class SentenceEmbedder(torch.nn.Module):
    """An encoder topped with mean pooling and L2 normalisation.

    Args:
        encoder: A transformers base model (``AutoModel``) returning ``last_hidden_state``.
    """

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                pooling_mask: torch.Tensor | None = None,
                **inputs: torch.Tensor) -> torch.Tensor:
        """``[rows, dim]`` unit vectors, float32.

        Args:
            attention_mask: What the encoder is given (the 2D mask, or one prepared from it).
            pooling_mask: The 2D ``[rows, seq_len]`` mask to pool under; None: ``attention_mask``.
        """
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **inputs,
                           return_dict=True)
        pooled = mean_pool(out.last_hidden_state,
                           attention_mask if pooling_mask is None else pooling_mask)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1)


class TaskOutputs(torch.nn.Module):
    """A task's model as positional tensors in, its outputs (``TASK_OUTPUT_NAMES[task]``) out.

    Args:
        model: The model as transformers loads it: a QA model, an encoder for ``embed``, a
            sequence-classification model.
        task: ``qa``, ``embed`` or ``classify``.
        input_names: The names of the positional inputs, in order.
        model_mask: What the model is given as its attention mask, made from the 2D one; None:
            the 2D mask itself. An embedder pools under the 2D mask either way.

    Raises:
        ValueError: Not a built-in task.
    """

    def __init__(self, model: torch.nn.Module, task: str, input_names: list[str],
                 model_mask: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        if task not in TASK_OUTPUT_NAMES:
            raise ValueError(f"no PyTorch outputs for task {task!r}; built in: "
                             f"{sorted(TASK_OUTPUT_NAMES)}")
        self.task = task
        self.model = SentenceEmbedder(model) if task == "embed" else model
        self.input_names = list(input_names)
        self.model_mask = model_mask

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The task's outputs for inputs given in ``input_names`` order."""
        return self.named(dict(zip(self.input_names, tensors, strict=True)))

    def named(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The task's outputs for inputs given by name."""
        given = inputs if self.model_mask is None else {
            **inputs, "attention_mask": self.model_mask(inputs["attention_mask"])}
        if self.task == "embed":
            return (self.model(**given, pooling_mask=inputs["attention_mask"]),)
        out = self.model(**given, return_dict=True)
        if self.task == "qa":
            return out.start_logits, out.end_logits
        return (out.logits,)


def load_task_model(task: str, model_dir: str | Path) -> torch.nn.Module:
    """The PyTorch weights of a prepared folder, loaded as ``task`` needs them (not wrapped), in
    float32 whatever dtype the folder saved (transformers 5 would keep the saved dtype; the
    engine casts to its precision itself).

    Raises:
        ValueError: Not a built-in task (a plug-in task's model runs on the ONNX engine).
    """
    from transformers import (
        AutoModel,
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
    )

    loaders = {"qa": AutoModelForQuestionAnswering, "embed": AutoModel,
               "classify": AutoModelForSequenceClassification}
    if task not in loaders:
        raise ValueError(f"the pytorch engine runs the built-in tasks {sorted(loaders)}, not "
                         f"{task!r}; serve it with the onnx engine")
    return loaders[task].from_pretrained(model_dir, dtype=torch.float32)
