"""``--config FILE``: the server reads its settings from a TOML file, flags on the command line
override it, and a file it cannot use stops the start with a usage error naming what is wrong."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from client import Client
from dispatch.registry import setting_registry
from settings.server_config import given_settings, parse_args
from tests.helpers import wait_for_address

ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_the_file_s_settings_are_read_and_the_command_line_wins(tmp_path: Path) -> None:
    config = write(tmp_path / "tuned.toml", 'num_inference_sessions = 3\nbatching = "off"\n'
                   "max_batch_tokens = 4096\nrequest_timeout_ms = 2500.5\nlog_level = "
                   '"WARNING"\n')
    registry = setting_registry()
    read = parse_args(None, ["--config", config], registry=registry)
    assert (read.num_inference_sessions, read.batching, read.max_batch_tokens) == (3, "off", 4096)
    assert read.request_timeout_ms == 2500.5
    over = parse_args(None, ["--num_inference_sessions", "1", f"--config={config}"],
                      registry=registry)
    assert (over.num_inference_sessions, over.batching) == (1, "off")  # the flag wins
    # given: the server does not lay itself out over what the file says
    assert {"num_inference_sessions", "batching"} <= given_settings(["--config", config],
                                                                    registry)
    assert "workers" not in given_settings(["--config", config], registry)


def test_the_log_says_the_file_was_read(tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    config = write(tmp_path / "tuned.toml", "num_inference_sessions = 3\n")
    with caplog.at_level("INFO", logger="server"):
        parse_args(None, ["--config", config], registry=setting_registry())
    assert f"settings read from {config} (flags given beside it win)" in caplog.messages
    caplog.clear()
    with caplog.at_level("INFO", logger="server"):
        parse_args(None, [], registry=setting_registry())
    assert not any("settings read" in m for m in caplog.messages)


@pytest.mark.parametrize(("text", "words"), [
    ("sessions = 2\n", "'sessions' is no setting of the server"),
    ("config = 'other.toml'\n", "'config' is no setting of the server"),
    ("num_inference_sessions = 'many'\n", "--num_inference_sessions: invalid int value"),
    ("num_inference_sessions = 0\n", "--num_inference_sessions"),
    ("batching = 'sometimes'\n", "--batching: invalid choice"),
    ("length_buckets = [64, 128]\n", "a setting is a number or a string"),
    ("host = \n", "not TOML"),
])
def test_a_file_the_server_cannot_use_is_a_usage_error_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str) -> None:
    config = write(tmp_path / "bad.toml", text)
    with pytest.raises(SystemExit) as exited:
        parse_args(None, ["--config", config], registry=setting_registry())
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_a_missing_file_or_two_files_are_usage_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = write(tmp_path / "one.toml", "port = 0\n")
    for argv, words in ((["--config", str(tmp_path / "absent.toml")], "cannot read it"),
                        (["--config", one, "--config", one], "takes one file, once"),
                        (["--config"], "takes one file, once")):
        with pytest.raises(SystemExit) as exited:
            parse_args(None, argv, registry=setting_registry())
        assert exited.value.code == 2 and words in capsys.readouterr().err


def test_server_py_serves_with_the_file_s_settings_under_the_command_line_s(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    address = tmp_path / "address"
    config = write(tmp_path / "tuned.toml", f'model_dir = "{tiny_model_dir}"\nport = 1\n'
                   "num_inference_sessions = 1\nmax_batch_size = 3\nthreads_per_session = 1\n")
    process = subprocess.Popen(
        [sys.executable, "server.py", "--config", config, "--port", "0", "--address_file",
         str(address), "--log_level", "WARNING"], cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        host, port = wait_for_address(address, process, 90)
        assert port != 1  # --port 0 on the command line won over the file's port
        with Client(host, port) as client:
            settings = client.stats(timeout=30)["config"]
        assert settings["max_batch_size"] == 3 and settings["num_inference_sessions"] == 1
        assert settings["model_dir"] == str(tiny_model_dir)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
