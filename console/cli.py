"""``python client.py``: the interactive REPL (console/repl.py), a one-shot question, a
readiness probe, or the server's stats (console/stats.py), against a running server."""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin from 3.11
from pathlib import Path
from typing import Any

from clients.blocking import Client
from clients.common import ConnectionLost
from clients.endpoint import describe
from console.catalog import model_warning
from console.modes import print_answer
from console.repl import repl
from console.stats import show_stats
from console.text_input import valid_text
from protocol import ServerError
from settings.cli import HelpFormatter, shout
from settings.tokens import add_token_options, token_from


def probe(client: Client, timeout: float) -> int:
    """Print the ping result; 0 if the server says it is ready, else 1."""
    try:
        result = client.ping(timeout=timeout)
    except (ServerError, ConnectionLost, FutureTimeout) as exc:
        print(f"not ready: {exc!r}", file=sys.stderr)
        return 1
    print(result)
    return 0 if result.get("ready") else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the context comes back in ``args.context`` whichever flag gave it."""
    p = argparse.ArgumentParser(
        description="Use the inference server. Without --question, --ready or --stats it starts "
        "the interactive REPL for a served model's task (a qa model's, where the server serves "
        "one, unless --model names another): qa (paste or type a text, then ask questions "
        "about it), embed (two texts: their cosine similarity) or classify (a text: its label).",
        formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the server's address, or "
                   "unix:///PATH for its Unix socket (server.py --unix_socket PATH)")
    p.add_argument("--port", type=int, default=9999, help="the server's port (not used with "
                   "unix://)")
    p.add_argument("--address_file", help="read the server's HOST:PORT (or unix:///PATH) from "
                   "this file, written by server.py --address_file once it serves (instead of "
                   "--host and --port)")
    add_tls_arguments(p)
    p.add_argument("--model", help="the served model to use (the server's `models` op names "
                   "them); without it: the only one; in the REPL, the qa model (the one named "
                   "qa, else the first by name), else pick one when several")
    once = p.add_mutually_exclusive_group()
    once.add_argument("--question", help="answer this once and exit (needs --context or "
                      "--context_file); without it, the REPL runs")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--context", help="the text the question is about (REPL: the first text)")
    text.add_argument("--context_file", help="read the text from this UTF-8 file, any length")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for an answer "
                   "(or the stats)")
    once.add_argument("--ready", action="store_true",
                      help="health probe: exit 0 if the server is ready, 1 if not (or it "
                      "refused the token), 2 if unreachable")
    once.add_argument("--stats", action="store_true", help="print the server's stats, per "
                      "model (docs/metrics.md), and exit: 0, 1 on an error reply, a refused "
                      "token or no reply within --timeout, 2 if unreachable")
    p.add_argument("--json", action="store_true", help="with --stats: the raw stats, as JSON")
    add_token_options(p)
    args = p.parse_args(argv)
    args.token = token_from(args, p)
    if args.context_file is not None:
        try:
            args.context = Path(args.context_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            p.error(f"cannot read --context_file: {exc}")
    if args.json and not args.stats:
        p.error("--json needs --stats")
    if args.question is not None and args.context is None:
        p.error("--question needs --context or --context_file")
    if not args.tls and (args.tls_ca or args.tls_cert or args.tls_key):
        p.error("--tls_ca, --tls_cert and --tls_key need --tls")
    return args


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """The client's TLS flags (server.py --tls_cert serves TLS)."""
    p.add_argument("--tls", action="store_true", help="connect over TLS; the server's "
                   "certificate must name --host and be signed by a CA of --tls_ca")
    p.add_argument("--tls_ca", help="PEM CA certificates to trust (default: the system's)")
    p.add_argument("--tls_cert", help="PEM client certificate, for a server with "
                   "--tls_client_ca")
    p.add_argument("--tls_key", help="its private key, where not in --tls_cert's file")


def tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Client`` keyword arguments of ``add_tls_arguments``' flags."""
    return {"tls": args.tls, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert,
            "tls_key": args.tls_key}


def one_shot(client: Client, question: str, context: str, timeout: float,
             model: str | None = None) -> int:
    """Answer one question and print it; returns the exit status."""
    if warning := model_warning(client, "qa", model, timeout):
        shout(warning, sys.stderr)
    started = time.perf_counter()
    try:
        result = client.answer(valid_text(question), valid_text(context), timeout=timeout,
                               model=model)
    except ServerError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 1
    print_answer(result, (time.perf_counter() - started) * 1000)
    return 0


def read_address_file(path: str) -> tuple[str, int]:
    """(host, port) from a server's ``--address_file``; a wildcard host means this machine;
    a ``unix:///PATH`` address comes back as the host, with port 0.

    Raises:
        OSError: no such file (the server is not serving), or it does not hold HOST:PORT.
    """
    text = Path(path).read_text(encoding="utf-8").strip()
    if text.startswith("unix://"):
        return text, 0
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise OSError(f"{path} holds {text!r}, not HOST:PORT")
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host), int(port)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2: the server, or the model, is not there, or
    the connection was lost; 1: it refused the token, or has none, or gave no reply in time)."""
    args = parse_args(argv)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach valid_text, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    where = args.address_file or f"{args.host}:{args.port}"
    try:
        if args.address_file is not None:
            args.host, args.port = read_address_file(args.address_file)
        client = Client(args.host, args.port, token=args.token, **tls_options(args))
    except ServerError as exc:  # it answered, and refused the token
        print(f"{where} refused the connection [{exc.code}]: {exc.message}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        where = args.address_file or describe(args.host, args.port, args.tls)
        print(f"cannot connect to {where}: {exc}", file=sys.stderr)
        return 2
    with client:
        try:
            if args.ready:
                return probe(client, args.timeout)
            if args.stats:
                return show_stats(client, args.timeout, as_json=args.json)
            if args.question is None:
                return repl(client, args.context, args.model)
            return one_shot(client, args.question, args.context, args.timeout, args.model)
        except ServerError as exc:  # e.g. unauthorized: the server wants a token
            print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
            return 1
        except ConnectionLost as exc:  # the server went away mid-call
            print(f"{where}: {exc}", file=sys.stderr)
            return 2
        except (FutureTimeout, TimeoutError):  # distinct classes before Python 3.11
            print(f"no reply from {where} within --timeout {args.timeout:g} s", file=sys.stderr)
            return 1
