"""What every command-line tool of the project shares: help that shows each default once,
and a notice nobody can miss."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and adds each option's default: "off" for an unset one,
    nothing for a switch or where the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return f"{text} (default: {'off' if action.default is None else '%(default)s'})"


def shout(text: str, stream: TextIO | None = None) -> None:
    """Print a notice nobody can miss (a warning the user must read), between two bars."""
    bar = "!" * 80
    print(f"\n{bar}\n{text}\n{bar}\n", file=stream or sys.stdout, flush=True)
