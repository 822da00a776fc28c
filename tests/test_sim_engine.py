"""The simulated GPU (--inference_engine_type sim): its costs follow the cost curve, processes
on one device id take turns, and a server lays itself out on simulated devices as on GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import Client
from engines import load_engine
from engines.cost_curve import CostCurveError, load_cost_curve
from engines.sim_device import DEFAULT_CURVE, SimDevice, SimSettings, device_index
from engines.sim_host import DEVICE_FLOOR, PARTS
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS

ROOT = Path(__file__).resolve().parent.parent


def feeds(engine: object, rows: int, length: int) -> dict[str, np.ndarray]:
    return {name: np.ones((rows, length), np.int64) for name in engine.input_names}  # type: ignore[attr-defined]


def test_a_run_costs_the_curve_s_device_time_scaled_with_outputs_of_the_batch_s_shape(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = SimSettings(scale=4.0, host=False, directory=str(tmp_path))
    engine = load_engine("sim", tiny_model_dir, device="cuda:3", sim=settings)
    try:
        curve = load_cost_curve(DEFAULT_CURVE)
        variant = curve.variants()[0]
        assert (engine.device, engine.device_bound, engine.precision) == ("sim:3", True, "fp16")
        assert "no model" in engine.describe() and "NVIDIA H200" in engine.describe()
        outputs = engine.run(feeds(engine, 5, 100))  # padded to the 8 x 128 cell
        assert {k: v.shape for k, v in outputs.items()} == \
            {"start_logits": (5, 100), "end_logits": (5, 100)}
        cell = curve.lookup(variant, 8, 128)
        assert engine.device_s == pytest.approx(cell.wall_ms_median / 4.0 / 1e3)
        assert engine.sim.busy_s() == pytest.approx(engine.device_s)
    finally:
        engine.close()


def test_host_parts_come_out_of_the_wall_time_and_the_device_gets_the_rest(
        tmp_path: Path) -> None:
    device = SimDevice(0, SimSettings(scale=2.0, directory=str(tmp_path)))
    try:
        for rows, length in [(1, 64), (5, 100), (32, 256), (64, 384)]:
            cost = device.cost(rows, length)
            assert set(cost.host_ms) == {part.name for part in PARTS}
            host_s = sum(cost.host_ms.values()) / 2.0 / 1e3  # the parts are scaled too
            assert cost.device_s + host_s == pytest.approx(device.device_ms(rows, length) / 1e3)
            assert cost.device_s >= DEVICE_FLOOR * device.device_ms(rows, length) / 1e3 - 1e-12
        small, large = device.cost(1, 64), device.cost(64, 256)
        assert sum(large.host_ms.values()) > sum(small.host_ms.values())  # more to copy
        assert "estimated" in device.host_source()
    finally:
        device.close()
    off = SimDevice(0, SimSettings(scale=2.0, host=False, directory=str(tmp_path)))
    try:
        assert off.cost(5, 100).host_ms == {}
        assert off.cost(5, 100).device_s == pytest.approx(off.device_ms(5, 100) / 1e3)
    finally:
        off.close()


def test_a_curve_s_measured_host_parts_are_spent_where_it_has_them(tmp_path: Path) -> None:
    data = json.loads(DEFAULT_CURVE.read_text())
    for cell in data["cells"]:
        cell["host_ms"] = {"pad": 0.1, "copy_in": 0.05, "launch": 0.02, "copy_out": 0.05,
                           "unpack": 0.08}
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(data))
    device = SimDevice(0, SimSettings(curve=str(path), scale=1.0, directory=str(tmp_path)))
    try:
        cost = device.cost(8, 128)
        assert cost.host_ms == pytest.approx({"pad": 0.1, "copy_in": 0.05, "launch": 0.02,
                                              "copy_out": 0.05, "unpack": 0.08})
        assert device.host_source() == "measured per shape by the GPU check"
    finally:
        device.close()
    data["cells"][0]["host_ms"] = {"pad": -1}
    path.write_text(json.dumps(data))
    with pytest.raises(CostCurveError, match="host_ms"):
        load_cost_curve(path)


def test_launched_runs_take_the_device_in_order_and_each_result_its_own_time(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = SimSettings(scale=4.0, directory=str(tmp_path))
    engine = load_engine("sim", tiny_model_dir, device="cuda:0", sim=settings)
    try:
        assert engine.overlaps
        shapes = [(5, 100), (32, 256), (1, 64)]
        launched = [engine.launch(feeds(engine, *shape)) for shape in shapes]
        for shape, run in zip(shapes, launched, strict=True):
            outputs = run.result()
            assert outputs["start_logits"].shape == shape
            assert run.device_s == pytest.approx(engine.sim.cost(*shape).device_s)
        busy = sum(engine.sim.cost(*shape).device_s for shape in shapes)
        assert engine.sim.busy_s() == pytest.approx(busy)  # the device's time, not the host's
    finally:
        engine.close()


def test_runs_handed_to_the_device_run_back_to_back_while_the_host_holds_the_gil(
        tmp_path: Path) -> None:
    device = SimDevice(0, SimSettings(scale=0.5, host=False, directory=str(tmp_path)))
    try:
        seconds = device.cost(32, 256).device_s
        tickets = [device.submit(seconds) for _ in range(3)]
        for before, after in zip(tickets, tickets[1:]):  # queued: no gap between them
            assert after.end == pytest.approx(before.end + seconds)
        assert device.busy_s() < 3 * seconds  # what it has still to run is not counted yet
        end = time.perf_counter() + (tickets[-1].end - time.monotonic()) + 0.01
        while time.perf_counter() < end:  # a host thread holding the GIL throughout: the
            pass  # device needs no thread of this process to go from one run to the next
        assert device.busy_s() == pytest.approx(3 * seconds)
        assert [ticket.wait() for ticket in tickets] == [seconds] * 3
    finally:
        device.close()


def test_past_the_grid_a_run_costs_in_proportion_to_its_tokens(tmp_path: Path) -> None:
    device = SimDevice(0, SimSettings(scale=1.0, directory=str(tmp_path)))
    try:
        assert device.device_ms(128, 384) == pytest.approx(2 * device.device_ms(64, 384))
        assert device.device_ms(64, 768) == pytest.approx(2 * device.device_ms(64, 384))
        assert device.device_ms(3, 70) == device.device_ms(4, 128)  # padded up within it
    finally:
        device.close()
    budgeted = SimDevice(0, SimSettings(scale=1.0, directory=str(tmp_path)), max_tokens=16384)
    try:  # 64 x 384 is over the budget: 40 rows run unpadded, between 32 and 64 rows' times
        low, high = budgeted.device_ms(32, 384), budgeted.device_ms(64, 384)
        assert budgeted.device_ms(40, 384) == pytest.approx(low + (high - low) * 8 / 32)
        assert budgeted.device_ms(40, 256) == budgeted.device_ms(64, 256)  # 64 x 256 is not
    finally:
        budgeted.close()


def test_auto_scale_is_this_machine_s_cores_over_the_measured_one_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    device = SimDevice(0, SimSettings(directory=str(tmp_path)))
    try:
        assert device.scale == pytest.approx(2 / 16)
        assert "0.125 x pytorch cuda:0 fp16 cudagraphs" in device.describe()
    finally:
        device.close()


def test_device_names_give_their_ids_and_a_bad_one_is_refused() -> None:
    assert [device_index(d) for d in ("auto", "cuda", "cuda:2", "sim:5")] == [0, 0, 2, 5]
    with pytest.raises(ValueError, match="cuda:0 or sim:0"):
        device_index("cuda:x")


def test_a_curve_missing_shapes_is_refused_at_load(tmp_path: Path) -> None:
    data = json.loads(DEFAULT_CURVE.read_text())
    gone = [c for c in data["cells"] if c["graph"] == "cudagraphs" and c["rows"] == 64]
    data["cells"] = [c for c in data["cells"] if c not in gone]
    data["skipped"] += [{**c, "why": "not reached"} for c in gone]
    path = tmp_path / "short.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="misses 4 shapes .64 x 64"):
        SimDevice(0, SimSettings(curve=str(path), directory=str(tmp_path)))


def test_the_busy_share_is_read_safely_beside_runs_and_not_after_close(tmp_path: Path) -> None:
    device = SimDevice(0, SimSettings(scale=1000.0, host=False, directory=str(tmp_path)))
    failures: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                share = device.busy_share()
                assert share is not None and 0 <= share <= 1
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
                return

    readers = [threading.Thread(target=read) for _ in range(2)]
    for reader in readers:
        reader.start()
    until = time.monotonic() + 1.0
    while time.monotonic() < until:  # runs add samples too; each read adds one
        device.run(1, 64)
    stop.set()
    for reader in readers:
        reader.join()
    assert failures == []
    device.close()
    assert device.busy_share() is None  # a stats query racing a session's close
    device.close()  # twice is harmless


def test_a_curve_without_a_gpu_variant_is_refused(tmp_path: Path) -> None:
    data = json.loads(DEFAULT_CURVE.read_text())
    for entry in data["cells"]:
        entry["device"] = "cpu"
    path = tmp_path / "cpu_only.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no cells measured on a GPU"):
        SimDevice(0, SimSettings(curve=str(path), directory=str(tmp_path)))


#: A child process: waits for a common start, runs the device ``runs`` times, prints its span.
CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
from engines.sim_device import SimDevice, SimSettings
device = SimDevice({index}, SimSettings(scale={scale}, host=False, directory={folder!r}))
while time.monotonic() < {start}:
    time.sleep(0.001)
began = time.monotonic()
for _ in range({runs}):
    device.run(64, 384)
print(json.dumps([began, time.monotonic(), device.device_ms(64, 384) / 1e3]))
"""


def run_pair(folder: Path, indices: tuple[int, int],
             runs: int = 10) -> tuple[float, float, float]:
    """Two processes on these device ids, started together: (their joint span, the longer of
    their own spans, one's device seconds)."""
    scale = 0.5  # 64 x 384: about 26 ms a run
    start = time.monotonic() + 2.5  # both processes are up by then
    children = [subprocess.Popen([sys.executable, "-c", CHILD.format(
        root=str(ROOT), index=i, scale=scale, folder=str(folder), start=start, runs=runs)],
        stdout=subprocess.PIPE, text=True) for i in indices]
    spans = [json.loads(child.communicate(timeout=120)[0]) for child in children]
    return (max(s[1] for s in spans) - min(s[0] for s in spans),
            max(s[1] - s[0] for s in spans), runs * spans[0][2])


def test_processes_on_one_device_take_turns_and_on_two_devices_run_at_once(
        tmp_path: Path) -> None:
    together, _, device_s = run_pair(tmp_path / "one", (0, 0))
    assert together >= 2 * device_s * 0.999  # one device: the runs never overlap
    shared = SimDevice(0, SimSettings(directory=str(tmp_path / "one")))
    try:
        assert shared.busy_s() == pytest.approx(2 * device_s)  # both processes' time, summed
    finally:
        shared.close()
    _, longest, device_s = run_pair(tmp_path / "two", (0, 1))
    assert longest < 1.6 * device_s  # two devices: neither waits for the other


def test_a_server_on_two_simulated_devices_reports_each_one_s_busy_share(
        tiny_model_dir: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), inference_engine_type="sim",
                          workers=2, cuda_devices="0,1", num_inference_sessions=1,
                          metrics_port=0, sim_scale=1.0)
    with InferenceServer(config) as srv, Client(*srv.address) as client:
        futures = [client.submit(q, c) for q, c in zip(QUESTIONS * 4, CONTEXTS * 4)]
        for future in futures:
            assert set(client.wait(future, 60)) == {"answer", "score", "start", "end"}
        stats = client.stats(timeout=30)
        assert stats["model"]["meaningful"] is False and "sim" in stats["model"]["warning"]
        assert sorted(w["device"] for w in stats["workers"]) == ["sim:0", "sim:1"]
        assert set(stats["devices"]) == {"sim:0", "sim:1"}
        assert all(0 < d["device_busy"] <= 1 for d in stats["devices"].values())
        host, port = srv.metrics_address
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        busy = {s.labels["device"]: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "qa_server_device_busy_ratio"}
        assert set(busy) == {"sim:0", "sim:1"}
        folder = Path(srv.config.sim_device_dir)
        assert sorted(p.name for p in folder.iterdir()) == ["sim-device-0", "sim-device-1"]
    assert not folder.exists()  # the server's own folder goes with it


def test_a_one_process_sim_server_fills_its_batches_under_load(tiny_model_dir: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), inference_engine_type="sim",
                          num_inference_sessions=1, max_batch_size=8, sim_scale=0.5)
    with InferenceServer(config) as srv, Client(*srv.address) as client:
        futures = [client.submit(q, c) for q, c in zip(QUESTIONS * 8, CONTEXTS * 8)]
        for future in futures:
            client.wait(future, 60)
        stats = client.stats(timeout=30)
        assert stats["engine"]["device_bound"] is True and stats["engine"]["type"] == "sim"
        assert stats["mean_batch_size"] > 2  # the device is dear and requests waited
        assert "sim:0" in stats["devices"]


def test_the_sim_layouts_benchmark_gives_each_layout_s_figures_against_the_device(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    done = subprocess.run(
        [sys.executable, "bench/sim_layouts.py", "--model_dir", str(tiny_model_dir),
         "--layouts", "one=", "two=--workers 2", "--rounds", "1", "--seconds", "1",
         "--one_client", "5", "--sessions", "1", "--sim_scale", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["ceilings"]["capacity_rps"] > 0 and record["ceilings"]["alone_device_ms"] > 0
    assert [row["layout"] for row in record["rows"]] == ["one", "two"]
    for row in record["rows"]:
        assert row["throughput_rps"] > 0 and not row["errors"]
        assert 0 < row["device_busy"] <= 1.01 and row["mean_batch"] >= 1
        assert row["of_capacity"] == pytest.approx(
            row["throughput_rps"] / record["ceilings"]["capacity_rps"])
    assert "| one |" in done.stdout and "| two |" in done.stdout
