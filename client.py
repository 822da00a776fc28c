"""The inference server's client: the command line, and the public import place of the client
libraries.

    python client.py                                   # the REPL against 127.0.0.1:9999
                                                       # (in its qa model, where it serves one)
    python client.py --model NAME                      # the REPL, with that served model
    python client.py --context_file article.txt        # the REPL, starting with that text
    python client.py --question "Who?" --context "Bob went home."
    python client.py --stats                           # the server's figures, per model
    python client.py --stats --json                    # the same, whole, as JSON
    python client.py --token_file my_token.txt         # a server with --auth_token_file
    python client.py --host unix:///run/qa/qa.sock     # over the server's Unix socket
    python client.py --host qa.example.org --tls --tls_ca ca.crt       # over TLS

The REPL and the command line live in console/ (console/cli.py); ``python client.py`` runs them.
The libraries live in clients/ (``Client``: clients/blocking.py; ``AsyncClient``: clients/aio.py)
and are re-exported here.

Library use::

    from client import Client
    with Client("127.0.0.1", 9999) as c:       # token="...": a server with --auth_token_file
        print(c.models())                                 # what the server serves
        print(c.answer("Who went home?", "Bob went home."))
        vectors = c.embed(["a cat", "a dog"])             # one unit vector per text
        print(c.classify("What a lovely day."))           # {label, score, scores}
        futures = [c.submit(q, ctx) for q in questions]   # pipelined on one connection
    with Client("unix:///run/qa/qa.sock") as c: ...      # a Unix socket: the port is ignored
    with Client("qa.example.org", 9999, tls=True, tls_ca="ca.crt") as c: ...

``AsyncClient`` (clients/aio.py) is the same for asyncio: ``async with AsyncClient(host, port) as
c: await c.answer(q, ctx)``.
"""

from __future__ import annotations

import sys

from clients.aio import AsyncClient
from clients.blocking import Client
from clients.common import ConnectionLost, Result

__all__ = ["AsyncClient", "Client", "ConnectionLost", "Result", "main"]


def main(argv: list[str] | None = None) -> int:
    """The command line (console/cli.py): the REPL, a one-shot question, a readiness probe or
    the server's stats; returns the exit status."""
    from console.cli import main as cli_main  # the libraries above need none of the console

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
