"""The layout ``python server.py`` chooses where its flags leave it open (workers/layout.py),
and which settings a command line gives (settings/server_config.given_settings)."""

from __future__ import annotations

from dispatch.registry import setting_registry
from settings.server_config import ServerConfig, given_settings
from workers.layout import choose_layout


def chosen(argv: list[str], cores: int, gpus: int | None = None) -> ServerConfig:
    registry = setting_registry()
    given = given_settings(argv, registry)
    names = {"--inference_engine_type": "inference_engine_type", "--device": "device",
             "--workers": "workers", "--cuda_devices": "cuda_devices",
             "--num_inference_sessions": "num_inference_sessions", "--broker": "broker",
             "--executors": "executors"}
    values = {names[flag]: value for flag, value in zip(argv[::2], argv[1::2], strict=True)}
    types = {"workers": int, "num_inference_sessions": int}
    config = ServerConfig(**{k: types.get(k, str)(v) for k, v in values.items()})
    return choose_layout(config, given, cores=cores, gpus=gpus).config


def test_given_settings_are_those_the_command_line_names() -> None:
    given = given_settings(["--workers", "3", "--model_dir=x", "--log_level", "DEBUG"],
                           setting_registry())
    assert given == {"workers", "model_dir"}


def test_a_gpu_box_gets_an_executor_per_gpu_and_a_worker_per_four_cores() -> None:
    sim = chosen(["--inference_engine_type", "sim"], cores=16)
    assert (sim.executors, sim.workers, sim.num_inference_sessions, sim.cuda_devices) == \
        ("on", 4, 4, "0")  # one simulated GPU unless told more
    assert chosen(["--inference_engine_type", "sim"], cores=2).workers == 2
    assert chosen(["--inference_engine_type", "sim"], cores=96).workers == 8
    two = chosen(["--inference_engine_type", "pytorch"], cores=16, gpus=2)
    assert (two.executors, two.cuda_devices, two.workers) == ("on", "0,1", 4)
    listed = chosen(["--inference_engine_type", "sim", "--cuda_devices", "0,1"], cores=2)
    assert listed.cuda_devices == "0,1" and listed.workers == 2
    one_of_two = chosen(["--inference_engine_type", "pytorch", "--device", "cuda:1"], cores=16,
                        gpus=2)
    assert one_of_two.cuda_devices == "1" and one_of_two.executors == "on"
    assert chosen(["--inference_engine_type", "sim", "--device", "cuda:1"],
                  cores=2).cuda_devices == "1"
    kept = chosen(["--inference_engine_type", "sim", "--num_inference_sessions", "2"], cores=2)
    assert kept.num_inference_sessions == 2 and kept.executors == "on"


def test_the_flags_and_a_cpu_only_machine_keep_one_process() -> None:
    for argv, gpus in ((["--inference_engine_type", "pytorch"], 0),
                       (["--inference_engine_type", "sim", "--device", "cpu"], None),
                       (["--inference_engine_type", "zero"], 1),
                       (["--inference_engine_type", "sim", "--workers", "3"], None),
                       (["--inference_engine_type", "sim", "--executors", "off"], None),
                       (["--inference_engine_type", "pytorch", "--broker",
                         "redis://127.0.0.1:1"], 1)):
        config = chosen(argv, cores=16, gpus=gpus)
        assert config.executors == "off", argv
        assert config.workers == (3 if "--workers" in argv else 1), argv
    why = choose_layout(ServerConfig(inference_engine_type="pytorch"), set(), cores=16).why
    assert why == "one process, which serves the most on the CPU (--workers N for more); no " \
        "GPU here" or "one executor per GPU" in why  # a machine with a GPU runs this test too
    # a GPU asked for that the engine cannot use is said, with why
    why = choose_layout(ServerConfig(inference_engine_type="pytorch", device="cuda"), set(),
                        cores=16, gpus=0).why
    assert why.startswith("one process on the CPU: no GPU for the pytorch engine")
