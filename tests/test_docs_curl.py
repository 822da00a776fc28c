"""Every ``curl`` command of README.md and docs/*.md runs as written against a real server's HTTP
API, and gets a 2xx answer with a body.

The server serves what the README's set-up makes (``saved_models/qa`` and ``embed``, prepared
if absent) and a tiny classify model named ``classify`` (docs/http.md's ``/predict`` needs one).
``localhost:8000`` in a command becomes the server's address; nothing else changes.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from server import InferenceServer
from settings.server_config import ServerConfig
from tests.doc_commands import DOCS, ROOT, shell_lines
from tests.text_models import build_tiny_classify_dir

CURL = re.compile(r"(?:^|\s)curl\s")


def curl_commands() -> list[tuple[str, str]]:
    """(FILE:LINE, command) of each curl command of the docs, comments dropped."""
    found = []
    for doc in DOCS:
        for line, text in shell_lines(doc.read_text()):
            if not CURL.search(f" {text}"):
                continue
            for part in re.split(r"\s(?:&&|;)\s", text):
                words = shlex.split(part, comments=True)
                if words and words[0] == "curl":
                    found.append((f"{doc.relative_to(ROOT)}:{line}", shlex.join(words)))
    return found


@pytest.fixture(scope="module")
def http_base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """127.0.0.1:PORT of a server of qa, embed and a tiny classify model."""
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine (.ci/run installs it)")
    repo = tmp_path_factory.mktemp("curl_repo")
    saved = ROOT / "saved_models"
    if not all((saved / name / "serving.json").is_file() for name in ("qa", "embed")):
        prepared = tmp_path_factory.mktemp("curl_prepared")  # the README's set-up, offline
        done = subprocess.run([sys.executable, str(ROOT / "prepare_model.py")], cwd=prepared,
                              capture_output=True, text=True)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        saved = prepared / "saved_models"
    for name in ("qa", "embed"):
        (repo / name).symlink_to(saved / name)
    build_tiny_classify_dir(repo / "classify")
    config = ServerConfig(model_dir=str(repo), port=0, num_inference_sessions=1,
                          max_batch_size=4)
    with InferenceServer(config) as server:
        assert server.http_address is not None
        host, port = server.http_address
        yield f"{host}:{port}"


def test_the_docs_have_curl_commands() -> None:
    """docs/http.md shows a curl command for each kind of route."""
    commands = " ".join(command for _, command in curl_commands())
    for route in ("/health/ready", "/health/live", "/qa", "/v1/embeddings", "/embed",
                  "/predict", "/v2/models/qa/infer", "/ops/", "/metrics", "/openapi.json"):
        assert route in commands, f"no curl command of the docs calls {route}"


@pytest.mark.parametrize(("where", "command"), curl_commands(), ids=[w for w, _ in curl_commands()])
def test_doc_curl_command_succeeds(where: str, command: str, http_base: str) -> None:
    """The command, run by bash as written (its address the server's), gets 2xx and a body."""
    run = command.replace("localhost:8000", http_base) + " -w '\\n%{http_code}'"
    done = subprocess.run(["bash", "-c", run], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{where}: {command}\n{done.stderr}"
    body, _, status = done.stdout.rpartition("\n")
    assert status.startswith("2"), f"{where}: {command}\nstatus {status}: {body[:500]}"
    assert body.strip() or "/v2/health" in command, f"{where}: {command}: an empty body"


def test_readme_first_screen_has_a_curl_line() -> None:
    """README's quick start shows the HTTP API with one curl line."""
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[:readme.index("## What it does")]
    assert "curl " in quick_start and "localhost:8000" in quick_start

