"""What the implementations say of the settings they own, handed to settings/ by the caller.

Some settings take values that belong to an implementation: the engine types engines/ can load,
the batching modes the planner knows, the CPU policies workers/ can set. Others are checked only
by the code that uses them: a TLS certificate that loads, a broker URL that Redis accepts. The
owning modules publish these (``SETTING_CHOICES`` beside their values, a check function beside
their code), the program that assembles the server collects them into a ``SettingRegistry``
(dispatch/registry.py's ``setting_registry``), and settings/ reads the registry it is given:
it never imports an implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: A setting's allowed values, as its owner publishes them: setting (field) name -> values.
Choices = Mapping[str, tuple[str, ...]]
#: A check only an implementation can make: the problems it finds in a ``ServerConfig`` (empty:
#: none). Typed loosely so that this module, which server_config.py imports, needs nothing back.
Check = Callable[[Any], list[str]]


class Owned:
    """The marker of a ``ServerConfig`` field whose choices come from the registry."""

    def __repr__(self) -> str:
        return "OWNED"


#: ``option(..., choices=OWNED)``: the allowed values are the registry's, not settings'.
OWNED = Owned()


@dataclass(frozen=True)
class SettingRegistry:
    """The allowed values of the owned settings, and the checks that need an implementation.

    Args:
        choices: Each owned setting's allowed values (merge the owners' ``SETTING_CHOICES``).
        checks: Functions of a config, each returning what is wrong with it (usage errors).
    """

    choices: Choices = field(default_factory=dict)
    checks: tuple[Check, ...] = ()

    def allowed(self, setting: str) -> tuple[str, ...]:
        """The allowed values of ``setting``.

        Raises:
            LookupError: no owner registered values for it (the registry is incomplete).
        """
        try:
            return tuple(self.choices[setting])
        except KeyError:
            raise LookupError(f"no allowed values registered for the setting {setting!r}: "
                              f"its owner's SETTING_CHOICES is missing from the registry "
                              f"(dispatch/registry.py's setting_registry)") from None

    def problems(self, config: Any) -> list[str]:
        """What the checks find wrong with ``config``, a ``ServerConfig`` (empty: nothing)."""
        return [problem for check in self.checks for problem in check(config)]
