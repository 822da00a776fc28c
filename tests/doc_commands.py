"""The server commands of README.md and docs/*.md, as tests/test_docs_commands.py runs them.

Extracted: lines of fenced blocks (```bash/sh/shell/console, ``$ `` prompts dropped, or no
language; backslash continuations joined) and inline `code` spans, split at ``&& || ; | &``,
comments dropped. A command beginning (after ``VAR=value``) with ``python``, ``python3`` or
``.venv/bin/python`` and ``server.py``, or with ``qa-server``, is one, named ``FILE:LINE``
(``#2``: the second on a line). ``docker``/``docker run`` lines begin otherwise and are not
extracted (no Docker engine here).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import dropwhile, groupby
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
FENCE = re.compile(r"^\s*(?:```|~~~)\s*([\w+-]*)")
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
CANDIDATE = re.compile(r"python3?\s+server\.py|(?:^|[\s/])qa-server(?:\s|$)")


@dataclass(frozen=True)
class DocCommand:
    """One server command of the docs: where it is and its words as written."""

    where: str  # FILE:LINE, #N for the Nth on a line
    doc: str
    line: int
    argv: tuple[str, ...]

    @property
    def text(self) -> str:
        return " ".join(self.argv)

    @property
    def key(self) -> tuple[str, ...]:
        """What it runs: the same for ``python server.py`` and ``.venv/bin/python server.py``."""
        return tuple(".venv/bin/python" if word in PYTHONS else word for word in self.argv)

    def flag(self, name: str) -> str | None:
        """The value of ``name``'s last occurrence, if any."""
        values = [self.argv[i + 1] for i, word in enumerate(self.argv[:-1]) if word == name]
        return values[-1] if values else None

    @property
    def role(self) -> str:
        if "--help" in self.argv or "-h" in self.argv:
            return "help"
        if self.flag("--role") == "worker":
            return "worker"
        return "front end" if self.flag("--broker") else "server"


def shell_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each fenced shell line (continuations joined, a ``$ `` prompt
    dropped) and of each inline span outside fences."""
    lines, language, i = text.splitlines(), None, 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        if fence := FENCE.match(line):
            language = fence.group(1).lower() if language is None else None
        elif language is None:
            yield from ((start, span) for span in re.findall(r"`([^`]+)`", line))
        elif language in SHELL_BLOCKS:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            yield start, line.lstrip().removeprefix("$ ")
        i += 1


def split_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell line, as words, comments dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    runs = groupby(lexer, lambda word: word in SEPARATORS)
    return [list(words) for separator, words in runs if not separator]


def starts_server(argv: list[str]) -> bool:
    """Whether ``argv`` runs server.py or qa-server (after any ``VAR=value`` words)."""
    words = [*dropwhile(ASSIGNMENT.match, argv), "", ""]
    return (words[0] in PYTHONS and words[1] == "server.py") or \
        words[0].split("/")[-1] == "qa-server"


@cache
def doc_commands() -> tuple[DocCommand, ...]:
    """Every server command of the docs, in order."""
    found: list[DocCommand] = []
    for path in DOCS:
        doc = path.relative_to(ROOT).as_posix()
        for line, text in shell_lines(path.read_text(encoding="utf-8")):
            if not CANDIDATE.search(text):  # prose, diagrams: not parsed as shell
                continue
            for argv in filter(starts_server, split_commands(text)):
                where = f"{doc}:{line}"
                same = sum(command.where.split("#")[0] == where for command in found)
                found.append(DocCommand(where + (f"#{same + 1}" if same else ""), doc, line,
                                        tuple(argv)))
    return tuple(found)
