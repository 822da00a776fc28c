"""Token files and the client tools' token options, shared by the server (``--auth_token_file``)
and the clients (``--token``, ``--token_file``). Light: the client image has msgpack alone.

A token file holds one token per line; blank lines and lines starting with ``#`` are ignored,
and each token is the line without its surrounding whitespace.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

#: The environment variables the client tools read a token from when no flag gives one.
TOKEN_ENV = "QA_SERVER_TOKEN"
TOKEN_FILE_ENV = "QA_SERVER_TOKEN_FILE"


class TokenFileError(ValueError):
    """A token file that cannot be read, or holds no token."""


def parse_tokens(text: str) -> list[str]:
    """The tokens of a token file's text, in order (blank lines and ``#`` comments left out)."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def read_tokens(path: str | Path) -> list[str]:
    """The tokens in the file at ``path``.

    Raises:
        TokenFileError: the file cannot be read (missing, no permission, not UTF-8), or it
            holds no token. The message names the file, never a token.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TokenFileError(f"cannot read token file {str(path)!r}: {reason}") from None
    tokens = parse_tokens(text)
    if not tokens:
        raise TokenFileError(f"token file {str(path)!r} holds no token (one per line; blank "
                             "lines and # comments are ignored)")
    return tokens


def add_token_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--token`` and ``--token_file`` (one or the other) to a client tool's parser."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--token", help="the token to authenticate with, for a server started "
                       f"with --auth_token_file (visible to `ps`: prefer --token_file or "
                       f"${TOKEN_ENV}; default: ${TOKEN_ENV}, else the first token of "
                       f"${TOKEN_FILE_ENV})")
    group.add_argument("--token_file", help="read the token from this file (its first token; "
                       "the server's --auth_token_file format)")


def token_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The token the options (or else the environment) give, None for none; a token file that
    cannot be read, or holds no token, is a usage error."""
    if args.token is not None:
        return args.token
    path = args.token_file
    if path is None and not os.environ.get(TOKEN_ENV):
        path = os.environ.get(TOKEN_FILE_ENV) or None
    if path is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        return read_tokens(path)[0]
    except TokenFileError as exc:
        parser.error(str(exc))
