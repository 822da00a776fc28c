"""The interactive REPL: it asks the server what it serves (the ``models`` op), picks a model
(``--model``; else a qa model; else the only one, or the user's choice), shows its warning if its
outputs are not meaningful, and runs that model's task (console/modes.py) until Ctrl+D.
``/model NAME`` switches models on the way."""

from __future__ import annotations

import sys

from clients.blocking import Client
from console.catalog import Model, find_model, served_models
from console.modes import GENERIC_HELP, HELP, MODES, generic_mode
from console.session import ModelSwitch, Session, announce, pick_model, switch_hint

#: The qa model the REPL starts with, where a server serves several and it is one of them.
DEFAULT_QA_NAME = "qa"


def default_qa(models: list[Model]) -> Model | None:
    """The qa model to start with: the one named ``qa``, else the first by name; None if no
    served model is a qa model."""
    qa = sorted((m for m in models if m["op"] == "qa"), key=lambda m: m["name"] or "")
    if not qa:
        return None
    return next((m for m in qa if m["name"] == DEFAULT_QA_NAME), qa[0])


def choose_model(models: list[Model], wanted: str | None) -> Model | None:
    """The model to start with: ``wanted``, else a qa model (``default_qa``), else the only
    one, else the user's pick; None (and a message on stderr) if ``wanted`` is not served.

    Raises:
        EOFError: the input ended before the user picked one.
    """
    if wanted is not None:
        model = find_model(models, wanted)
        if model is None:
            served = ", ".join(f"{m['name']} ({m['task']})" for m in models)
            print(f"no model {wanted!r} here (served: {served})", file=sys.stderr)
        return model
    if (qa := default_qa(models)) is not None:
        return qa
    if len(models) == 1:
        return models[0]
    return pick_model(models)


def repl(client: Client, context: str | None = None, model: str | None = None) -> int:
    """Run the REPL of the chosen model's task until EOF (Ctrl+D) or Ctrl+C.

    Args:
        client: The connection to use (replaced by a fresh one if the server closes it).
        context: The first text, if already known (``--context`` or ``--context_file``).
        model: The served model to use (``--model``); None: a qa model, else the only one, or
            ask.

    Returns:
        The exit status: 0, or 2 when ``model`` is not served.
    """
    try:
        print(f"connected to {client.endpoint} ({client.ping()})")
        models = served_models(client)
        chosen = choose_model(models, model)
        if chosen is None:
            return 2
        session = Session(client, models, chosen)
        _serve(session, context)
    except (EOFError, KeyboardInterrupt):
        print()
    except OSError as exc:
        print(f"connection to {client.endpoint} lost: {exc}")
    return 0


def _serve(session: Session, context: str | None) -> None:
    """Run the model's mode; again with the new model after each ``/model NAME``."""
    several, announced = len(session.models) > 1, False
    while True:
        if not announced:
            announce(session.model)
        print(HELP.get(session.model["op"], GENERIC_HELP))
        if several:
            print(switch_hint(session.models, session.model))
        mode = MODES.get(session.model["op"], generic_mode)
        try:
            mode(session, context)
        except ModelSwitch:
            context, announced = None, True  # the switch announced the new model
