"""pyproject.toml: the wheel holds every runtime module and data file and declares the qa-*
commands, and the installed layout serves, away from the checkout (worker processes included).

The wheel is built from a copy of the checkout with this venv's setuptools (no build isolation:
nothing is downloaded), and installed with ``--no-deps --target`` on top of this venv's packages,
so no dependency is installed again.
"""

from __future__ import annotations

import configparser
import importlib
import inspect
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.helpers import CONTEXTS, QUESTIONS, wait_for_address

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"qa-server": "server:main", "qa-client": "client:main",
           "qa-stress": "stress_test:main", "qa-prepare": "prepare_model:main",
           "qa-tune": "tune:main"}
NOT_SHIPPED = {"tests", "docs", "docker", "saved_models"}  # folders the wheel leaves out


def _skipped(folder: str, names: list[str]) -> set[str]:
    """What the copy leaves out: dot folders (.git, .venv, ...), build output, models, caches."""
    return {n for n in names if n.startswith(".") or n in NOT_SHIPPED or n.endswith(".egg-info")
            or n in ("__pycache__", "build", "dist") or (n == "results" and folder.endswith(
                "bench"))}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools", minversion="70.1", reason="builds the wheel offline")
    source = tmp_path_factory.mktemp("source") / "tree"
    shutil.copytree(ROOT, source, ignore=_skipped)
    dist = source / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(dist), str(source)],
                   check=True, timeout=300, capture_output=True, text=True)
    [built] = dist.glob("qa_inference_server-*.whl")
    return built


def code_files() -> set[str]:
    """Every file the programs may load: the top-level modules (not setup.py, which builds),
    every .py file of every code folder (any folder holding .py files, but the tests), and the
    shipped request mix and cost curve."""
    files = {p.name for p in ROOT.glob("*.py") if p.name != "setup.py"}
    files |= {"bench/data/qa_pairs.jsonl", "engines/data/cost_curve_h200.json"}
    for folder in ROOT.iterdir():
        if folder.is_dir() and not _skipped(str(ROOT), [folder.name]):
            files |= {p.relative_to(ROOT).as_posix() for p in folder.rglob("*.py")
                      if "__pycache__" not in p.parts}
    return files


def test_the_wheel_holds_every_runtime_file_and_nothing_else(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    ours = {n for n in names if ".dist-info/" not in n}
    expected = code_files()
    assert {"server.py", "client.py", "stress_test.py", "prepare_model.py",
            "clients/aio.py", "bench/loadgen.py", "workers/worker_main.py"} <= expected
    assert sorted(expected - ours) == [], "not in the wheel: list its package in pyproject.toml"
    built = {n for n in ours if n.startswith("tasks/_span_search.") and n.endswith(".so")}
    assert sorted(ours - expected - built) == []  # no tests, docs, C sources or stray files
    if os.environ.get("QA_REQUIRE_C_SPAN_SEARCH") == "1":  # CI, which has a C compiler
        assert len(built) == 1, "the wheel lacks the C span search"


def test_the_wheel_declares_the_commands_its_dependencies_and_python(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        dist_info = next(n.split("/")[0] for n in archive.namelist() if ".dist-info/" in n)
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
        metadata = Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    assert dict(parser["console_scripts"]) == SCRIPTS
    pinned = [line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert metadata.get_all("Requires-Dist") == pinned
    assert metadata["Requires-Python"] == ">=3.10"


@pytest.mark.parametrize("target", sorted(SCRIPTS.values()))
def test_each_command_is_a_main_taking_argv(target: str) -> None:
    module, function = target.split(":")
    main = getattr(importlib.import_module(module), function)
    parameter = inspect.signature(main).parameters["argv"]
    assert parameter.default is None and inspect.signature(main).return_annotation in (int, "int")


def test_the_installed_commands_serve_away_from_the_checkout(wheel: Path, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-compile", "--target", str(site), str(wheel)],
                   check=True, timeout=300, capture_output=True, text=True)
    env = {**os.environ, "PYTHONPATH": str(site)}  # this venv's packages, and the wheel's files
    work = tmp_path / "elsewhere"  # not the checkout: nothing may come from there
    work.mkdir()

    def command(name: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(site / "bin" / name), *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=180)

    where = subprocess.run(
        [sys.executable, "-c", "import server, bench.mix as m, preparation.fp16 as f; "
         "print(server.__file__, m.DEFAULT_DATA.is_file(), f.EVALUATION_FILE.is_file())"],
        cwd=work, env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    assert where.split() == [str(site / "server.py"), "True", "True"]
    address_file = work / "address"
    server = subprocess.Popen(
        [str(site / "bin" / "qa-server"), "--port", "0", "--model_dir", str(tiny_model_dir),
         "--workers", "2", "--num_inference_sessions", "1", "--address_file", str(address_file)],
        cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        host, number = wait_for_address(address_file, server, 120, "qa-server")
        port = str(number)
        asked = command("qa-client", "--address_file", str(address_file), "--question",
                        QUESTIONS[0], "--context", CONTEXTS[0])
        assert asked.returncode == 0 and "answer: " in asked.stdout, asked.stderr
        loaded = command("qa-stress", "--host", host, "--port", port, "--num_total_clients", "2",
                         "--num_simultaneous_clients", "2", "--num_request_per_client", "3",
                         "--warmup", "0")  # its default request mix, from the installed package
        assert loaded.returncode == 0 and "requests: 6   ok: 6" in loaded.stdout, loaded.stderr
        assert command("qa-prepare", "--help").returncode == 0
        tuned = command("qa-tune", "--model_dir", str(tiny_model_dir), "--search", "grid",
                        "--trial_s", "1", "--clients", "2", "--p99_ms", "5000", "--no_progress",
                        "--", "--workers", "1", "--num_inference_sessions", "1",
                        "--threads_per_session", "1", "--batching", "off")  # one trial
        assert tuned.returncode == 0 and "meets" in tuned.stdout, tuned.stdout + tuned.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        _, log = server.communicate(timeout=60)
    assert server.returncode == 0, log
    assert "2 workers" in log and "worker_lost" not in log
