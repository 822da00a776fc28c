"""bench/bench.py for every task: each model's raw-engine ceiling through the task contract, and
the server loaded with that model's own requests, end to end on tiny real models (no timed
assertions: speed is measured by the benchmark, never by tests)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench import find_targets
from bench.mix import load_mix
from bench.raw import load_raw_task, run_batches, task_requests
from engines import load_engine
from protocol.messages import ClassifyRequest, EmbedRequest, QARequest
from tests.text_models import build_tiny_classify_dir, build_tiny_embed_dir

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A lone qa folder, and a repository holding an embed and a classify model."""
    root = tmp_path_factory.mktemp("bench_models")
    shutil.copytree(tiny_model_dir, root / "qa")
    build_tiny_embed_dir(root / "repo" / "embed")
    build_tiny_classify_dir(root / "repo" / "classify")
    return {"qa": root / "qa", "repo": root / "repo", "embed": root / "repo" / "embed",
            "classify": root / "repo" / "classify"}


def test_the_mix_becomes_each_tasks_protocol_requests(models: dict[str, Path]) -> None:
    expected = {"qa": QARequest, "embed": EmbedRequest, "classify": ClassifyRequest}
    for task, kind in expected.items():
        items = load_mix(task)[:3]
        requests = task_requests(load_raw_task(models[task]), items)
        assert [type(r) for r in requests] == [kind] * 3
        assert [r.id for r in requests] == [0, 1, 2]
    texts = load_mix("embed", texts_per_request=2)[0]["texts"]
    embed = task_requests(load_raw_task(models["embed"]), [{"texts": texts}])[0]
    assert isinstance(embed, EmbedRequest) and embed.texts == tuple(texts)
    question, context = load_mix("qa")[0]
    qa = task_requests(load_raw_task(models["qa"]), [(question, context)])[0]
    assert isinstance(qa, QARequest) and (qa.question, qa.context) == (question, context)


def test_a_raw_batch_runs_the_whole_task_contract(models: dict[str, Path]) -> None:
    for task in ("qa", "embed", "classify"):
        loaded = load_raw_task(models[task])
        requests = task_requests(loaded, load_mix(task)[:4])
        engine = load_engine("onnx", models[task], threads=1)
        seconds = run_batches(loaded, engine, requests, size=2, count=3, offset=1)
        assert len(seconds) == 3 and all(s > 0 for s in seconds)


def test_targets_are_every_model_found_or_those_of_one_task(models: dict[str, Path]) -> None:
    dirs = [str(models["qa"]), str(models["repo"])]
    targets = find_targets(dirs)
    assert [(t.name, t.task, t.op, t.named) for t in targets] == [
        ("qa", "qa", "qa", False), ("classify", "classify", "classify", True),
        ("embed", "embed", "embed", True)]
    assert [t.served for t in targets] == [dirs[0], dirs[1], dirs[1]]
    assert [t.name for t in find_targets(dirs, "embed")] == ["embed"]
    with pytest.raises(ValueError, match="no classify model"):
        find_targets([str(models["qa"])], "classify")


def test_the_benchmark_holds_each_task_to_its_own_raw_ceiling(models: dict[str, Path],
                                                              tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "bench/bench.py", "--model_dir", str(models["qa"]), str(models["repo"]),
         "--engines", "onnx", "--batch_sizes", "1,2", "--concurrency", "1,4", "--raw_pairs", "4",
         "--server_requests", "8", "--batching", "auto", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    tasks = {m["name"]: m["task"] for m in figures["models"]}
    assert tasks == {"qa": "qa", "embed": "embed", "classify": "classify"}
    for name in tasks:
        raw = [r for r in figures["raw"] if r["model"] == name]
        assert [(r["batch_size"], "parallel" in r["layout"]) for r in raw] == \
            [(1, False), (2, False), (1, True)]
        assert all(r["task"] == tasks[name] and r["pairs_per_s"] > 0 for r in raw)
        server = [r for r in figures["server"] if r["model"] == name]
        assert [r["concurrency"] for r in server] == [1, 4]
        assert all(r["ok"] == r["requests"] > 0 and not r["errors"] for r in server)
        assert all(r["settings"]["op"] == tasks[name] for r in server)
        best = max(r["pairs_per_s"] for r in raw)
        ratios = [r for r in figures["ratios"] if r["model"] == name]
        for ratio, row in zip(ratios, server, strict=True):
            assert ratio["best_raw"] == best
            assert ratio["ratio"] == pytest.approx(row["throughput_rps"] / best)
        assert [r["saturation"] for r in ratios] == [False, True]
        assert f"## {name} ({tasks[name]}, " in done.stdout
