"""What a server serves, as the command line and the REPL need it: its models (the ``models``
op), the one a request goes to, and the warning to show for a model whose outputs mean nothing."""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout  # the builtin from 3.11
from typing import Any

from clients.blocking import Client
from clients.common import ConnectionLost
from protocol import BadRequest, ServerError

Model = dict[str, Any]
"""One entry of the ``models`` op: ``{name, task, op, inputs, meaningful, ready, warning?}``."""

QA_INPUTS = {"question": "string", "context": "string"}


def served_models(client: Client, timeout: float | None = 10.0) -> list[Model]:
    """The server's models. A server older than the ``models`` op serves one qa model: it is
    described from its ``stats`` (with no name, so requests name none).

    Raises:
        ServerError, ConnectionLost, TimeoutError: as the requests raise them.
    """
    try:
        return client.models(timeout)
    except BadRequest:  # "unknown op": an older server
        model = client.stats(timeout).get("model", {})
        entry: Model = {"name": None, "task": "qa", "op": "qa", "inputs": dict(QA_INPUTS),
                        "meaningful": model.get("meaningful", True), "ready": True}
        if model.get("warning"):
            entry["warning"] = model["warning"]
        return [entry]


def find_model(models: list[Model], name: str) -> Model | None:
    """The served model called ``name``; None if there is none."""
    return next((m for m in models if m["name"] == name), None)


def routed_to(models: list[Model], op: str, name: str | None) -> Model | None:
    """The model a request of ``op`` naming ``name`` (or none) goes to, as the server routes it;
    None where it would be refused (no such model, or several serve ``op`` and none is named)."""
    if name is not None:
        return find_model(models, name)
    serving = [m for m in models if m["op"] == op]
    return serving[0] if len(serving) == 1 else None


def warning_of(model: Model) -> str | None:
    """What to tell the user before using ``model``: its warning if its outputs are not
    meaningful, else None."""
    if model.get("meaningful", True):
        return None
    name = model.get("name")
    text = model.get("warning") or f"the outputs of this {model['task']} model are not meaningful"
    return f"model {name}: {text}" if name else text


def model_warning(client: Client, op: str = "qa", name: str | None = None,
                  timeout: float | None = 10.0) -> str | None:
    """The warning for the model that a request of ``op`` naming ``name`` goes to (None if its
    outputs are meaningful, or if the server does not say)."""
    try:
        model = routed_to(served_models(client, timeout), op, name)
    except (ServerError, ConnectionLost, FutureTimeout):
        return None
    return warning_of(model) if model is not None else None


def describe(model: Model) -> str:
    """One line about a served model: name, task, inputs, and whether it is usable."""
    inputs = ", ".join(model.get("inputs", {})) or "no fields"
    notes = [] if model.get("meaningful", True) else ["outputs not meaningful"]
    if not model.get("ready", True):
        notes.append("not ready")
    extra = f"  [{'; '.join(notes)}]" if notes else ""
    return f"{model['name']}: {model['task']} (op {model['op']}: {inputs}){extra}"
