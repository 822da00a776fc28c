"""Every shell command of README.md and docs/*.md that starts the server, run as written.

Each command tests/doc_commands.py extracts is a test, id ``FILE:LINE``.

Each runs after the README's set-up (``.venv``; ``saved_models/qa`` and ``embed``, made by
``.venv/bin/python prepare_model.py`` if absent) from a stand-in for the repository root: links
to its entries, ``saved_models`` holding just ``qa`` and ``embed``, and the files the docs have
the user make (``server.crt``/``server.key``/``ca.crt`` by openssl, ``tokens.txt``): nothing is
written to the checkout. ``python`` is the venv's (``.venv/bin`` first on PATH); HF_HUB_OFFLINE=1.
Placeholders: ``--port <free>`` is appended (the later flag wins), ``--http_port <free>``
unless the command turns HTTP off (its ``/health/live`` must answer), ``--metrics_port <free>`` too
where one is set; ``--host 0.0.0.0`` stays; ``...`` (more flags) is dropped; a ``--broker`` URL
becomes a throwaway redis-server's. A server must answer ``ping`` on each address it serves
(TCP, Unix socket; TLS and token as given), ``ready`` (a front end alone: just answer),
``/metrics`` where set, and exit 0 within STOP_S of SIGINT. A worker runs beside the nearest
front end command of its doc (else one started with its ``--model_dir``) until that front end's
``stats`` count a serving worker for each model it holds (``--models``, else all); both then
exit 0. ``--help`` exits 0 with its usage. Commands alike but for how ``python`` is named run
once. SKIPS lists, with reasons, the few that cannot run here; anything else runs, so a new
server command in the docs must work or be added there, and a SKIPS row no command matches fails.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from itertools import dropwhile
from pathlib import Path
from typing import Any

import pytest
from onnxruntime import get_available_providers

from broker.local_server import RedisServer, free_port, make_certificates
from client import Client, ConnectionLost
from engines.devices import torch_cuda_gpus
from tests.doc_commands import ASSIGNMENT, DocCommand, doc_commands

ROOT = Path(__file__).resolve().parent.parent
START_S, STOP_S = 90.0, 30.0  # to be ready (5-20 s on 2 busy cores), to exit once signalled
INSTALLED = ("the installed package's command (the README's other set-up, `pip install .`; "
             "the one run here installs the requirements): .ci/run runs the wheel's --help")
NEEDS_GPU = ("needs a GPU: --device cuda:0 on a CPU box refuses to start (exit 2: this "
             "onnxruntime build has no CUDA provider); runs where PyTorch sees a CUDA device "
             "(the engine chosen there) or onnxruntime has CUDA")
SKIPS: dict[str, str] = {  # a command's words, joined by one space -> why it does not run
    ".venv/bin/qa-server": INSTALLED,
    "qa-server": INSTALLED,
    "qa-server --port 8000 --num_inference_sessions 4":
        "the Docker image's arguments (qa-server is the image there); no Docker engine here",
    ".venv/bin/python server.py --role worker --broker redis://:PW@redis:6379/0 --device cuda:0":
        NEEDS_GPU,
    ".venv/bin/python server.py --role worker --broker redis://:change-me@redis-host:6379/0 "
    "--device cuda:0": NEEDS_GPU,
    ".venv/bin/python server.py --config tuned.toml":
        "reads what `tune.py --out tuned.toml` writes, a 10-minute run first; test_tune.py reads "
        "such a file back with server.py's parser, and test_config_file.py serves one",
}


def skip_of(command: DocCommand) -> str | None:
    """Why ``command`` does not run here, or None; NEEDS_GPU rows run where ``--device cuda:0``
    can: PyTorch sees a CUDA device (the server then chooses PyTorch: workers/engine_choice.py),
    or onnxruntime has CUDA."""
    reason = SKIPS.get(command.text)
    cuda = reason == NEEDS_GPU and (torch_cuda_gpus() > 0 or
                                    "CUDAExecutionProvider" in get_available_providers())
    return None if cuda else reason


def environment(argv: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """A command's words to run (``...`` dropped) and its environment: the venv's ``python``
    first on PATH, HF_HUB_OFFLINE=1, and the command's own ``VAR=value`` assignments."""
    words = list(dropwhile(ASSIGNMENT.match, argv))
    assigned = dict(word.split("=", 1) for word in argv[:len(argv) - len(words)])
    path = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return [word for word in words if word != "..."], {
        **os.environ, "PATH": path, "HF_HUB_OFFLINE": "1", **assigned}


class Running:
    """A command started in the stand-in root, its output in a log file; stop() checks exit 0."""

    def __init__(self, argv: tuple[str, ...], root: Path, log: Path, **flags: str) -> None:
        words, env = environment(argv)
        if "--broker" in flags:  # the throwaway redis-server's URL instead of the doc's
            words[words.index("--broker") + 1] = flags.pop("--broker")
        for flag, value in flags.items():
            words += [flag, value]
        self.argv, self.log = words, log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(words, cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, env=env)

    def tail(self) -> str:
        """The command run and the end of its log."""
        lines = self.log.read_text(errors="replace").splitlines()[-25:]
        return "\n  log: ".join([shlex.join(self.argv), *lines])

    def alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise AssertionError(f"exited {code} before it answered:\n{self.tail()}")

    def stop(self) -> None:
        """SIGINT, then exit status 0 within STOP_S."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_S)
        code = self.process.poll()
        said = f"still running {STOP_S:.0f} s later" if code is None else f"exit status {code}"
        assert code == 0, f"after SIGINT, {said}:\n{self.tail()}"

    def kill(self) -> None:
        """Its process group (worker processes too), where anything of it still runs."""
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


Check = Callable[[Client], bool]  # asks a server something: is what it says what we wait for?


def ready(connection: Client) -> bool:
    """Its ping says ready."""
    reply = connection.ping(timeout=1)
    assert reply.get("pong") is True, reply
    return bool(reply["ready"])


def answers(connection: Client) -> bool:
    """It answers ping, ready or not (a front end without workers is not)."""
    return ready(connection) or True


def serving(models: str | None) -> Check:
    """A front end counts a live worker for each of ``models`` (``a,b``; None: all it serves)."""
    def workers_serving(connection: Client) -> bool:
        stats = connection.stats(timeout=1)["models"]
        names = models.split(",") if models else list(stats)
        return all(stats[name]["broker"]["serving_workers"] > 0 for name in names)
    return workers_serving


def wait_for(started: list[Running], check: Check, host: str, port: int, **client: Any) -> None:
    """Until ``check`` holds at ``host``/``port``, within START_S, while all ``started`` run."""
    deadline, last = time.monotonic() + START_S, "nothing"
    connection: Client | None = None
    while time.monotonic() < deadline:
        for running in started:
            running.alive()
        try:
            connection = connection or Client(host, port, connect_timeout=2, **client)
            if check(connection):
                connection.close()
                return
            last = f"{check.__name__}: no"
            time.sleep(0.2)
        except TimeoutError:  # bound but loading (it accepts once loaded): ask again
            last = "no reply yet"
        except (OSError, ConnectionLost) as exc:  # not bound yet
            if connection is not None:
                connection.close()
            connection, last = None, repr(exc)
            time.sleep(0.2)
    raise AssertionError(f"{check.__name__}: not at {host}:{port} within {START_S:.0f} s "
                         f"(last: {last}):\n{started[-1].tail()}")


def check_server(started: list[Running], root: Path, check: Check) -> None:
    """``check`` holds on every address the server ``started[0]`` serves; /metrics answers
    where it has one."""
    command = DocCommand("", "", 0, tuple(started[0].argv))
    client: dict[str, Any] = {}
    if command.flag("--tls_cert"):
        client.update(tls=True, tls_ca=str(root / "ca.crt"))
    if token_file := command.flag("--auth_token_file"):
        client["token"] = (root / token_file).read_text().split()[0]
    if command.flag("--port") != "-1":
        wait_for(started, check, "127.0.0.1", int(command.flag("--port") or 9999), **client)
    if socket_path := command.flag("--unix_socket"):  # never TLS
        wait_for(started, check, f"unix://{socket_path}", 0, token=client.get("token"))
    if metrics := command.flag("--metrics_port"):
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as reply:
            assert reply.status == 200 and b"# TYPE" in reply.read()
    if (http := command.flag("--http_port")) and http != "-1":  # the HTTP API's probe
        scheme = "https" if command.flag("--tls_cert") else "http"
        context = ssl.create_default_context(cafile=str(root / "ca.crt")) \
            if scheme == "https" else None
        with urllib.request.urlopen(f"{scheme}://127.0.0.1:{http}/health/live", timeout=10,
                                    context=context) as reply:
            assert reply.status == 200 and b"live" in reply.read()


Unit = tuple[DocCommand, DocCommand | None]  # (a server, a front end or --help; its worker)


def run_unit(unit: Unit, root: Path, folder: Path) -> tuple[str | None, str | None]:
    """Run a unit; what went wrong with its server and with its worker (None: nothing)."""
    server, worker = unit
    started: list[Running] = []
    errors: list[str | None] = [None, None]
    redis: RedisServer | None = None
    broker: dict[str, str] = {}
    try:
        if server.role == "help":
            words, env = environment(server.argv)
            done = subprocess.run(words, cwd=root, capture_output=True, text=True, timeout=60,
                                  env=env)
            assert done.returncode == 0 and "usage:" in done.stdout, done.stdout + done.stderr
            return None, None
        if server.role == "front end":
            folder.mkdir()
            redis = RedisServer(folder)
            redis.start()
            broker["--broker"] = redis.url
        ports = {"--port": str(free_port())} if server.flag("--port") != "-1" else {}
        if server.flag("--metrics_port"):
            ports["--metrics_port"] = str(free_port())
        if server.flag("--http_port") != "-1":  # never the default 8000: units run at once
            ports["--http_port"] = str(free_port())
        started.append(Running(server.argv, root, folder.with_suffix(".log"), **broker, **ports))
        if worker is not None:
            started.append(Running(worker.argv, root, folder.with_suffix(".worker.log"),
                                   **broker))
        check_server(started[:1], root, ready if server.role == "server" else answers)
        if worker is not None:  # the front end counts it as serving its models
            try:
                check_server(started, root, serving(worker.flag("--models")))
            except AssertionError as exc:
                errors[1] = str(exc)
        for index, running in enumerate(started):
            try:
                running.stop()
            except AssertionError as exc:
                errors[index] = errors[index] or str(exc)
    except Exception as exc:  # any: the report says which command and why
        errors = [f"{type(exc).__name__}: {exc}"] * 2
    finally:
        for running in started:
            running.kill()
        if redis is not None:
            redis.stop()
    return errors[0], errors[1]


def loads_model(unit: Unit) -> bool:
    """Whether a unit loads and warms up a real model. Such units run one at a time: servers
    warming up at once time each other's contention into their cost models and go on to time
    bigger batches (two at a time took 63 s in all against 45 s one at a time)."""
    server, worker = unit
    return worker is not None or (server.role == "server"
                                  and server.flag("--inference_engine_type") != "sim")


def plan(selected: list[DocCommand]) -> list[Unit]:
    """What to run for the commands selected: each worker with the nearest front end command
    of its doc, every other command alone, each once; the slowest (``--workers``) first."""
    units: dict[tuple[Any, ...], Unit] = {}
    for command in selected:
        if command.role == "worker" and skip_of(command) is None:
            fronts = [c for c in doc_commands() if c.doc == command.doc
                      and c.role == "front end" and skip_of(c) is None]
            front = min(fronts, key=lambda c: abs(c.line - command.line), default=None)
            front = front or DocCommand(  # none in its doc: one like it
                "", "", 0, (".venv/bin/python", "server.py", "--broker", "URL", "--model_dir",
                            command.flag("--model_dir") or "saved_models"))
            units[(front.key, command.key)] = (front, command)
    paired = {front.key for front, _ in units.values()}
    for command in selected:
        if skip_of(command) is None and command.role != "worker" and command.key not in paired:
            units.setdefault((command.key, None), (command, None))
    return sorted(units.values(), key=lambda unit: "--workers" not in unit[0].argv)


def stand_in_root(root: Path) -> Path:
    """The repository root as links, with saved_models/{qa,embed} and the files docs create."""
    root.mkdir()
    made = {"saved_models", "server.crt", "server.key", "ca.crt", "tokens.txt"}
    for entry in ROOT.iterdir():
        if entry.name not in made:
            (root / entry.name).symlink_to(entry)
    (root / "saved_models").mkdir()
    if all((ROOT / "saved_models" / name / "serving.json").is_file() for name in ("qa", "embed")):
        for name in ("qa", "embed"):
            (root / "saved_models" / name).symlink_to(ROOT / "saved_models" / name)
    else:  # the README's set-up, as on a fresh checkout: offline, about 8 s on 2 cores
        words, env = environment((".venv/bin/python", "prepare_model.py"))
        done = subprocess.run(words, cwd=root, capture_output=True, text=True, env=env)
        assert done.returncode == 0, f"prepare_model.py: {done.stdout}{done.stderr}"[-4000:]
    make_certificates(root.parent)  # its other files stay out of the stand-in
    for name in ("server.crt", "server.key", "ca.crt"):
        (root / name).symlink_to(root.parent / name)
    (root / "tokens.txt").write_text(secrets.token_urlsafe(32) + "\n")
    (root / "tokens.txt").chmod(0o600)
    return root


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """{where: None (ran as its doc says) or what went wrong}, for the commands selected."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv in the checkout: the README's set-up was not done")
    specs = [getattr(item, "callspec", None) for item in request.session.items
             if item.path == request.path]  # this module's tests selected in this session
    selected = [spec.params["command"] for spec in specs if spec is not None]
    units = plan(selected)
    temp = tmp_path_factory.mktemp("docs_commands")
    root = stand_in_root(temp / "root")
    lanes = ([n for n, unit in enumerate(units) if loads_model(unit)],
             [n for n, unit in enumerate(units) if not loads_model(unit)])
    with ThreadPoolExecutor(len(lanes)) as pool:
        ran = pool.map(lambda lane: {n: run_unit(units[n], root, temp / f"unit{n}")
                                     for n in lane}, lanes)
        results = {n: errors for lane in ran for n, errors in lane.items()}
    by_key: dict[tuple[str, ...], str | None] = {}
    for n, (server, worker) in enumerate(units):  # a front end of several units: any error
        by_key[server.key] = by_key.get(server.key) or results[n][0]
        if worker is not None:
            by_key[worker.key] = results[n][1]
    return {command.where: by_key[command.key] for command in selected if command.key in by_key}


@pytest.mark.parametrize("command", doc_commands(), ids=lambda command: command.where)
def test_doc_command_serves_and_stops(command: DocCommand,
                                      outcomes: dict[str, str | None]) -> None:
    """The command starts a server that answers ping, and stops with exit 0 on SIGINT."""
    skip = skip_of(command)
    if skip is not None:
        pytest.skip(f"{command.text}: {skip}")
    assert command.where in outcomes, f"{command.text}: not run (no rule runs it)"
    if outcomes[command.where] is not None:
        pytest.fail(f"{command.where}: {command.text}\n{outcomes[command.where]}", pytrace=False)


def test_skip_table_names_commands_of_the_docs() -> None:
    """Every SKIPS row is a command of the docs still, and the docs have server commands."""
    texts = {command.text for command in doc_commands()}
    assert set(SKIPS) <= texts, f"stale SKIPS rows: {sorted(set(SKIPS) - texts)}"
    assert any(command.where.startswith("README.md:") for command in doc_commands())
