"""The model folder that prepare_model.py writes and the engines load.

Layout (every file at the top level of the folder)::

    serving.json        metadata below (written last: its presence means the folder is complete)
    config.json, model.safetensors      PyTorch weights (save_pretrained)
    tokenizer.json, tokenizer_config.json, vocab.txt, ...   the fast tokenizer
    model.onnx          ONNX export, dynamic batch and sequence axes

This module only reads and writes metadata; it imports neither torch nor onnxruntime.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METADATA_FILE = "serving.json"
ONNX_FILE = "model.onnx"
FORMAT_VERSION = 1

NOT_MEANINGFUL_WARNING = (
    "THIS MODEL'S ANSWERS ARE NOT MEANINGFUL: its question-answering head is freshly initialised "
    "(random) on top of a pretrained encoder. It has the compute cost of a real BERT-QA model and is "
    "fit for benchmarks and end-to-end checks only. Run prepare_model.py with hub access for a "
    "trained model."
)

RANDOM_MODEL_WARNING = (
    "THIS MODEL'S ANSWERS ARE NOT MEANINGFUL: every weight is random (a bert-base-sized "
    "BertConfig, no training). It has the compute cost of bert-base and is fit for benchmarks only."
)


class ModelDirError(Exception):
    """The model folder is missing, incomplete or of an unknown format."""


@dataclass(kw_only=True)
class ModelInfo:
    """What serving.json says about a prepared model folder."""

    model_name: str
    source: str
    input_names: list[str]
    task: str = "qa"  # tasks/__init__.py: a built-in task's name, or "module:Class"
    output_names: list[str] = field(default_factory=lambda: ["start_logits", "end_logits"])
    meaningful: bool = True
    warning: str | None = None
    squad2: bool = False
    max_seq_len: int = 384
    onnx_file: str = ONNX_FILE
    onnx_opset: int = 17
    onnx_max_abs_diff: float | None = None
    fp16: dict[str, Any] | None = None  # preparation/fp16.py: its file and its parity with fp32
    #: preparation/torch_fp16.py: PyTorch float16 on CUDA against float32, where prepare_model.py
    #: ran on a GPU (``agrees``: within its threshold); None: not checked
    torch_fp16: dict[str, Any] | None = None
    labels: list[str] | None = None  # classify: the label of each logit, in order
    embedding_dim: int | None = None  # embed: the length of each vector
    created: str = ""
    format: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """Serialise as pretty JSON."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def load_model_info(model_dir: str | Path) -> ModelInfo:
    """Read ``serving.json`` from a prepared model folder.

    Raises:
        ModelDirError: the folder or its metadata is missing or unreadable, with a hint to run
            prepare_model.py.
    """
    path = Path(model_dir) / METADATA_FILE
    if not path.is_file():
        raise ModelDirError(
            f"no prepared model in {Path(model_dir).resolve()} (missing {METADATA_FILE}); "
            "run `python prepare_model.py` first"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} holds a JSON {type(data).__name__}, not an object")
    if data.get("format") != FORMAT_VERSION:
        raise ModelDirError(f"{path} has format {data.get('format')!r}, expected {FORMAT_VERSION}")
    if problems := _type_problems(data):
        raise ModelDirError(f"{path}: {'; '.join(problems)}")
    known = set(ModelInfo.__dataclass_fields__)
    return ModelInfo(**{k: v for k, v in data.items() if k in known})


def _is_names(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


#: What each serving.json field must hold (fields not listed: anything), and in words.
_FIELD_TYPES: dict[str, tuple[Any, str]] = {
    **dict.fromkeys(("model_name", "source", "task", "onnx_file"),
                    (lambda v: isinstance(v, str), "a string")),
    **dict.fromkeys(("input_names", "output_names"), (_is_names, "a non-empty list of strings")),
    **dict.fromkeys(("meaningful", "squad2"), (lambda v: isinstance(v, bool), "true or false")),
    **dict.fromkeys(("max_seq_len", "onnx_opset"),
                    (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                     "a positive integer")),
    "warning": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "labels": (lambda v: v is None or _is_names(v), "null or a non-empty list of strings"),
    **dict.fromkeys(("fp16", "torch_fp16"),
                    (lambda v: v is None or isinstance(v, dict), "an object or null")),
    "embedding_dim": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
                      "an integer or null"),
}


def _type_problems(data: dict[str, Any]) -> list[str]:
    """What is wrong with serving.json's fields, in words (empty: nothing)."""
    missing = [f"{name} is missing" for name in ("model_name", "source", "input_names")
               if name not in data]
    wrong = [f"{name} must be {words}, not {data[name]!r}"
             for name, (ok, words) in _FIELD_TYPES.items() if name in data and not ok(data[name])]
    return missing + wrong


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hash of the folder's serving.json and tokenizer.json: equal for copies of one
    prepared folder, different for another model (or the same one prepared again)."""
    digest = hashlib.sha256()
    for name in (METADATA_FILE, "tokenizer.json"):
        path = Path(model_dir) / name
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()[:16]


def save_model_info(model_dir: str | Path, info: ModelInfo) -> Path:
    """Write ``serving.json`` atomically (temp file, then rename)."""
    path = Path(model_dir) / METADATA_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(info.to_json(), encoding="utf-8")
    tmp.replace(path)
    return path


def find_models(model_dir: str | Path) -> list[tuple[str, Path]]:
    """(name, folder) of each model in ``model_dir``: itself if it is a prepared model folder,
    else each subfolder that is one, by name.

    Raises:
        ModelDirError: no prepared model there.
    """
    root = Path(model_dir)
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if root.is_dir() else []
    found = [p for p in folders if (p / METADATA_FILE).is_file()]
    if (root / METADATA_FILE).is_file():
        if found:  # e.g. `prepare_model.py --task embed` after a model was written to the root
            log.warning("%s is a model folder itself, so the models in its subfolders (%s) are "
                        "not served; give each model a subfolder of its own", root,
                        ", ".join(p.name for p in found))
        return [(root.resolve().name, root)]
    if not found:
        raise ModelDirError(f"no prepared model in {root.resolve()} (no {METADATA_FILE} in it or "
                            "in its subfolders); run `python prepare_model.py` first")
    if skipped := [p.name for p in folders if p not in found]:  # an interrupted prepare, say
        log.warning("not served, no %s in them: %s", METADATA_FILE, ", ".join(skipped))
    return [(path.name, path) for path in found]
