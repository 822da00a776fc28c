"""The REPL's state: the connection (renewed when the server closed it), the served models and
the one in use, and the commands that list and switch them (``/models``, ``/model NAME``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from clients.blocking import Client
from clients.common import ConnectionLost
from console.catalog import Model, describe, find_model, warning_of
from console.text_input import read_text, valid_text
from protocol.errors import IdleTimeout
from settings.cli import shout

T = TypeVar("T")

COMMANDS_HELP = ("/models lists the served models, /model NAME switches to one, "
                 "/help shows this.")
PICK_PROMPT = "model (number or name)> "


class ModelSwitch(Exception):  # noqa: N818 - a signal to the REPL's loop, not an error
    """The user switched to another model: the REPL starts that model's task."""


class Session:
    """One REPL's connection and model.

    Args:
        client: The connection (replaced by a fresh one if the server closes it).
        models: The served models (the ``models`` op).
        model: The one in use.
    """

    def __init__(self, client: Client, models: list[Model], model: Model) -> None:
        self.client = client
        self.models = models
        self.model = model

    @property
    def name(self) -> str | None:
        """The model's name, sent with every request (None: a server that names none)."""
        return self.model["name"]

    def run(self, call: Callable[[Client], T]) -> T:
        """``call(client)``, reconnecting once if the server had closed the connection (it closes
        idle ones: the request may meet the closed connection, or its ``idle_timeout`` reply
        still on its way)."""
        try:
            return call(self.client)
        except (ConnectionLost, IdleTimeout):
            self.client.close()
            self.client = self.client.reopen()
            return call(self.client)

    def read_text(self, prompt: str) -> str:
        """One text from the user (console/text_input.py), after any commands typed instead.

        Raises:
            ModelSwitch: ``/model NAME`` chose another model.
            EOFError: the input ended.
        """
        while self.command(text := read_text(prompt)):
            pass
        return text

    def read_line(self, prompt: str) -> str:
        """One line from the user, after any commands typed instead.

        Raises:
            ModelSwitch, EOFError: as ``read_text``.
        """
        while self.command(line := valid_text(input(prompt)).strip()):
            pass
        return line

    def command(self, line: str) -> bool:
        """Carry out ``line`` if it is a command; True if it was one.

        Raises:
            ModelSwitch: it switched to another model.
        """
        words = line.split()
        if not words or "\n" in line or words[0] not in ("/models", "/model", "/help"):
            return False
        if words[0] == "/help" or (words[0] == "/model" and len(words) != 2):
            print(f"  {COMMANDS_HELP}")
        elif words[0] == "/models":
            list_models(self.models, self.model)
        elif (model := find_model(self.models, words[1])) is None:
            print(f"  no model {words[1]!r} here; /models lists them")
        else:
            self.model = model
            announce(model)
            raise ModelSwitch(model["name"])
        return True


def list_models(models: list[Model], current: Model | None = None) -> None:
    """Print the served models, numbered, marking the one in use."""
    for number, model in enumerate(models, 1):
        mark = "*" if model is current else " "
        print(f" {mark}{number}. {describe(model)}")


def switch_hint(models: list[Model], current: Model) -> str:
    """One line: the other served models, and how to switch to one."""
    others = ", ".join(f"{m['name']} ({m['task']})" for m in models if m is not current)
    return f"also served: {others}. {COMMANDS_HELP}"


def announce(model: Model) -> None:
    """Say which model is in use, and shout its warning if its outputs mean nothing."""
    if model["name"] is not None:  # (an older server names none)
        print(f"model {model['name']} ({model['task']})")
    if warning := warning_of(model):
        shout(warning)


def pick_model(models: list[Model]) -> Model:
    """Ask the user which of several models to use (by number or name) until one is named.

    Raises:
        EOFError: the input ended first.
    """
    print("this server serves several models:")
    list_models(models)
    while True:
        answer = input(PICK_PROMPT).strip()
        if answer.isdigit() and 1 <= int(answer) <= len(models):
            return models[int(answer) - 1]
        if (model := find_model(models, answer)) is not None:
            return model
        print(f"  pick a number from 1 to {len(models)}, or a name")
