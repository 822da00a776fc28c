"""From tune.py's options to a tuning ``Plan``: the model to load, the fixed server flags
checked as server.py checks them, the machine, and the candidates."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from bench.mix import TASKS, load_mix
from settings.choices import SettingRegistry
from settings.server_config import (
    ServerConfig,
    config_from_args,
    full_parser,
    given_settings,
    setting_flags,
)
from tuning.choice import Asked
from tuning.space import Machine, search_space
from tuning.trial import Server
from tuning.tuner import Plan
from workers.engine_choice import choose_engine

#: Engines whose answers are random: their trials' answers are not checked.
RANDOM_ENGINES = ("zero", "sim")
#: Items of the mix used at most (each one's reference answer is computed first).
MAX_ITEMS = 256
#: Server flags the tuner owns or cannot load through: each trial listens on 127.0.0.1, a free
#: port, plain TCP, no token, the whole of --model_dir.
REFUSED = {"model_dir": "give tune.py's own --model_dir", "port": "", "host": "",
           "unix_socket": "", "address_file": "", "role": "", "broker": "",
           "auth_token_file": "", "tls_cert": "", "tls_key": "", "tls_client_ca": "",
           "metrics_port": ""}


class SetupError(Exception):
    """What tune.py was asked cannot be tuned: said in one line."""


def plan_from(args: argparse.Namespace, fixed: list[str], asked: Asked,
              registry: SettingRegistry) -> Plan:
    """The plan of tune.py's ``args``, the objective ``asked`` and the server flags ``fixed``.

    Raises:
        SetupError: a fixed flag server.py refuses or the tuner owns, no model to tune, a model
            of a task the load cannot send, or a mix that cannot be read.
    """
    config, given = _fixed_settings(fixed, registry)
    if owned := sorted(given & set(REFUSED)):
        raise SetupError(f"--{owned[0]} after -- is the tuner's to set (each trial listens on "
                         "127.0.0.1, a free port, plain TCP, no token): tune without it and add "
                         "it to the winner's command line")
    if chosen := _engine_flags(config, given, args.model_dir):  # server.py's own pick
        fixed = [*fixed, *chosen]
        config, given = _fixed_settings(fixed, registry)
    device = config.device if "device" in given else None
    engine = config.inference_engine_type
    machine = Machine.here(engine, device)
    name, folder, task, several = _model(args.model_dir, args.model)
    if task not in TASKS:
        raise SetupError(f"model {name} is a {task} model; the tuner loads {', '.join(TASKS)}")
    try:
        items = load_mix(task, args.data)[:MAX_ITEMS]
    except (OSError, ValueError) as exc:
        raise SetupError(f"--data: {exc}") from None
    server = Server(args.model_dir, engine, tuple(fixed), cwd=Path.cwd())
    return Plan(server, str(folder), items, asked, config,
                search_space(machine, {k: getattr(config, k) for k in given}), args.budget_s,
                device=device or "auto", gpu=machine.gpus > 0,
                grid_load_s=args.trial_s if args.search == "grid" else None,
                machine_words=machine.describe(), check_answers=engine not in RANDOM_ENGINES,
                fixed_settings=_as_file_settings(config, given), op=task,
                model_name=name if several else None)


def _as_file_settings(config: ServerConfig, given: set[str]) -> tuple[tuple[str, Any], ...]:
    """The fixed settings as ``--config`` file names (each flag without its dashes) and
    values, in ServerConfig's order: what the winner's settings file holds first."""
    return tuple((flag[2:], getattr(config, name)) for name, flag in setting_flags().items()
                 if name in given)


def _engine_flags(config: ServerConfig, given: set[str], model_dir: str) -> list[str]:
    """The engine server.py chooses for itself here (workers/engine_choice.py: PyTorch on a GPU
    box), as a flag, where the fixed flags leave it open: so that the trials, and the winner's
    settings file, run the engine server.py would run (its precision is searched on a GPU)."""
    if "inference_engine_type" in given:
        return []
    chosen = choose_engine(replace(config, model_dir=model_dir), given).config
    engine = chosen.inference_engine_type
    return [] if engine == config.inference_engine_type else ["--inference_engine_type", engine]


def _fixed_settings(fixed: list[str], registry: SettingRegistry) -> tuple[ServerConfig,
                                                                         set[str]]:
    """The server's settings under the fixed flags (checked as server.py checks them), and
    the names of those the flags give."""
    parser = full_parser(None, registry)

    def refuse(message: str) -> NoReturn:
        raise SetupError(f"the server flags after --: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    parsed = vars(parser.parse_args(fixed))
    if parsed.pop("config"):
        refuse("--config: give the file's settings as flags, so the tuner knows them")
    parsed.pop("log_level")
    return config_from_args(parser, parsed, registry), given_settings(fixed, registry)


def _model(model_dir: str, model: str | None) -> tuple[str, Path, str, bool]:
    """(name, folder, task, whether the repository holds several) of the model to tune for."""
    from engines.model_dir import ModelDirError, find_models, load_model_info

    try:
        found = dict(find_models(model_dir))
    except (ModelDirError, OSError) as exc:
        raise SetupError(f"--model_dir {model_dir}: {exc}") from None
    name = model or (next(iter(found)) if len(found) == 1 else "qa" if "qa" in found else None)
    if name is None:
        raise SetupError(f"{model_dir} holds several models ({', '.join(found)}): name one "
                         "with --model")
    if name not in found:
        raise SetupError(f"no model {name!r} in {model_dir} (its models: {', '.join(found)})")
    try:
        task = load_model_info(found[name]).task
    except (ModelDirError, OSError, ValueError) as exc:
        raise SetupError(f"model {name}: {exc}") from None
    return name, found[name], task, len(found) > 1
