"""``--config FILE``: the server's settings from a TOML file, under the command line's.

The file holds ``name = value`` lines, a name being a flag without its dashes::

    num_inference_sessions = 4
    batching = "auto"
    max_batch_tokens = 8192

(what ``qa-tune --out FILE`` writes). Its settings go before the command line's flags, so a
flag given on the command line wins, and they count as given: the server does not lay itself
out over them (workers/layout.py). Values are checked as the flags' are.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import tomllib

#: The flag that names the file.
CONFIG_FLAG = "--config"


class ConfigFileError(ValueError):
    """A ``--config`` file that cannot be read, or holds what no flag takes."""


def with_config_file(argv: list[str], flags: Collection[str]) -> list[str]:
    """``argv`` with its ``--config FILE`` replaced by the file's settings, put first (so the
    command line's own flags win); ``argv`` itself where it names no file.

    Args:
        argv: The command line, without the program's name.
        flags: The flags a setting may be given by (``--name``).

    Raises:
        ConfigFileError: the file is named twice or not at all after the flag, cannot be read,
            is not TOML, or holds a name no flag takes or a value that is not a number or a
            string.
    """
    path, rest = _split(argv)
    return rest if path is None else [*file_args(path, flags), *rest]


def config_file_named(argv: list[str]) -> str | None:
    """The file ``--config`` names on ``argv`` (None: none, or not one file once)."""
    try:
        return _split(argv)[0]
    except ConfigFileError:
        return None


def _split(argv: list[str]) -> tuple[str | None, list[str]]:
    paths, rest, words = [], [], iter(argv)
    for word in words:
        if word == CONFIG_FLAG:
            paths.append(next(words, None))
        elif word.startswith(CONFIG_FLAG + "="):
            paths.append(word.split("=", 1)[1])
        else:
            rest.append(word)
    if len(paths) > 1 or None in paths or "" in paths:
        raise ConfigFileError(f"{CONFIG_FLAG} takes one file, once")
    return (paths[0] if paths else None), rest


def file_args(path: str, flags: Collection[str]) -> list[str]:
    """The settings of the TOML file at ``path`` as command-line words.

    Raises:
        ConfigFileError: as ``with_config_file``.
    """
    try:
        settings = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: cannot read it: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: not TOML: {exc}") from exc
    words = []
    for name, value in settings.items():
        flag = "--" + name
        if flag == CONFIG_FLAG or flag not in flags:
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: {name!r} is no setting of the server "
                                  "(names are its flags without the dashes: --help lists them)")
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: {name} = {value!r}: a setting is a "
                                  "number or a string")
        words += [flag, str(value)]
    return words
