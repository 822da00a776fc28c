"""Tasks: what a served model does with a request (tasks/base.py has the contract).

Built in: ``qa`` (extractive question answering), ``embed`` (sentence embeddings) and
``classify`` (sequence classification). serving.json's ``task`` names one of them, or a plug-in
task as ``"package.module:ClassName"`` (docs/tasks.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engines.model_dir import ModelInfo
    from settings.server_config import ServerConfig
    from tasks.base import Task

#: Task name -> "module:class" of its implementation.
BUILT_IN_TASKS: dict[str, str] = {"qa": "tasks.qa:QATask", "embed": "tasks.embed:EmbedTask",
                                  "classify": "tasks.classify:ClassifyTask"}


def task_class(name: str) -> Any:
    """The class of a task named in serving.json: a built-in name or "module:Class".

    Raises:
        ValueError: not built in, and not an importable "module:Class".
    """
    target = BUILT_IN_TASKS.get(name, name)
    module_name, _, class_name = target.partition(":")
    if not class_name:
        raise ValueError(f"unknown task {name!r}: not one of {sorted(BUILT_IN_TASKS)} and not a "
                         "plug-in given as 'module:Class'")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load task {name!r}: {exc}") from exc


def load_task(model_dir: str | Path, info: ModelInfo, config: ServerConfig) -> Task:
    """Build the task of a prepared model folder (``info.task``) under the server's settings."""
    return task_class(info.task).from_model(model_dir, info, config)
