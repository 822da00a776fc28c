"""prepare_model.py offline: one command gives a servable model, and says when answers mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client import Client
from server import InferenceServer, ServerConfig

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run_prepare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "prepare_model.py", *args], cwd=ROOT, env=OFFLINE,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_default_command_offline_falls_back_to_packaged_minilm_and_serves(tmp_path: Path) -> None:
    out = tmp_path / "model"
    done = run_prepare("--output", str(out))
    assert done.returncode == 0, done.stderr
    assert "falling back to the packaged MiniLM" in done.stderr
    assert "NOT MEANINGFUL" in done.stderr  # said loudly ...
    meta = json.loads((out / "serving.json").read_text())
    assert meta["meaningful"] is False and "NOT MEANINGFUL" in meta["warning"]  # ... and recorded
    assert meta["model_name"] == "minilm-l6-random-qa-head"
    assert meta["onnx_max_abs_diff"] < 1e-3
    assert "largest logit difference" in done.stdout

    context = "The committee met in Geneva on 4 May 2021 to discuss the new rail tunnel."
    for engine in ("onnx", "pytorch"):
        config = ServerConfig(port=0, model_dir=str(out), inference_engine_type=engine,
                              num_inference_sessions=1)
        with InferenceServer(config) as server, Client(*server.address) as client:
            result = client.answer("Where did the committee meet?", context, timeout=60)
        assert context[result["start"]:result["end"]] == result["answer"] != ""


def test_no_fallback_fails_when_the_model_cannot_be_loaded(tmp_path: Path) -> None:
    done = run_prepare("--model", "no-such-org/no-such-model", "--no-fallback",
                       "--output", str(tmp_path / "m"))
    assert done.returncode != 0
    assert not (tmp_path / "m" / "serving.json").exists()


def test_a_local_model_folder_is_prepared_and_keeps_its_not_meaningful_mark(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    done = run_prepare("--model", str(tiny_model_dir), "--output", str(tmp_path / "m"),
                       "--squad2", "yes")
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
    done = run_prepare("--model", str(plain), "--output", str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "m" / "serving.json").read_text())
    assert meta["meaningful"] is True and meta["warning"] is None and meta["squad2"] is False
    assert "NOT MEANINGFUL" not in done.stderr
