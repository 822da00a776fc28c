"""The interactive REPL: it asks the server what it serves (the ``models`` op), picks a model
(``--model``, the only one, or the user's choice), shows its warning if its outputs are not
meaningful, and runs that model's task (console/modes.py) until Ctrl+D. ``/model NAME`` switches
models on the way."""

from __future__ import annotations

import sys

from clients.blocking import Client
from console.catalog import Model, find_model, served_models
from console.modes import GENERIC_HELP, HELP, MODES, generic_mode
from console.session import COMMANDS_HELP, ModelSwitch, Session, announce, pick_model


def choose_model(models: list[Model], wanted: str | None) -> Model | None:
    """The model to start with: ``wanted``, else the only one, else the user's pick; None (and
    a message on stderr) if ``wanted`` is not served.

    Raises:
        EOFError: the input ended before the user picked one.
    """
    if wanted is not None:
        model = find_model(models, wanted)
        if model is None:
            served = ", ".join(f"{m['name']} ({m['task']})" for m in models)
            print(f"no model {wanted!r} here (served: {served})", file=sys.stderr)
        return model
    if len(models) == 1:
        return models[0]
    return pick_model(models)


def repl(client: Client, context: str | None = None, model: str | None = None) -> int:
    """Run the REPL of the chosen model's task until EOF (Ctrl+D) or Ctrl+C.

    Args:
        client: The connection to use (replaced by a fresh one if the server closes it).
        context: The first text, if already known (``--context`` or ``--context_file``).
        model: The served model to use (``--model``); None: the only one, or ask.

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
            print(COMMANDS_HELP)
        mode = MODES.get(session.model["op"], generic_mode)
        try:
            mode(session, context)
        except ModelSwitch:
            context, announced = None, True  # the switch announced the new model
