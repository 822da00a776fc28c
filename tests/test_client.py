"""client.py: the library's failure behaviour, the one-shot CLI and the REPL, against a real server."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Client, ConnectionLost
from protocol import FrameDecoder
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          threads_per_session=1)
    with InferenceServer(config) as srv:
        yield srv


def test_pending_and_later_requests_fail_with_connection_lost_when_the_peer_closes() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = Client(*listener.getsockname()[:2])
    peer, _ = listener.accept()
    future = client.submit("Who?", "Bob.")
    peer.recv(1024)  # the request arrived
    peer.close()
    with pytest.raises(ConnectionLost):
        future.result(timeout=10)
    with pytest.raises(ConnectionLost):
        client.submit("Who?", "Bob.")
    client.close()
    listener.close()


def test_one_shot_cli_prints_the_answer_and_latency(server: InferenceServer) -> None:
    host, port = server.address
    done = subprocess.run(
        [sys.executable, "client.py", "--host", host, "--port", str(port),
         "--question", QUESTIONS[4], "--context", CONTEXTS[4]],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert "answer: " in done.stdout and "latency: " in done.stdout and " ms" in done.stdout
    assert done.stderr.count("NOT MEANINGFUL") == 1  # the tiny model's answers mean nothing


def test_one_shot_reads_a_long_context_from_a_file(server: InferenceServer,
                                                   tmp_path: Path) -> None:
    host, port = server.address
    article = tmp_path / "article.txt"
    context = "\n\n".join(CONTEXTS * 40)
    article.write_text(context, encoding="utf-8")
    rows_before = server.stats.snapshot()["batch_rows"]
    done = subprocess.run(
        [sys.executable, "client.py", "--host", host, "--port", str(port),
         "--question", QUESTIONS[4], "--context_file", str(article)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "answer: " in done.stdout
    assert server.backend.task is not None  # every window of the whole file was run:
    assert server.stats.snapshot()["batch_rows"] - rows_before == \
        server.backend.task.preprocess(QUESTIONS[4], context).rows
    missing = subprocess.run([sys.executable, "client.py", "--question", "Who?", "--context_file",
                              str(tmp_path / "none.txt")], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "cannot read --context_file" in missing.stderr


def test_repl_asks_for_a_text_then_answers_questions(server: InferenceServer) -> None:
    host, port = server.address
    session = f"{CONTEXTS[0]}\n{QUESTIONS[0]}\nWhere is it?\n\n{CONTEXTS[1]}\n{QUESTIONS[1]}\n"
    out = subprocess.run([sys.executable, "client.py", "--host", host, "--port", str(port)],
                         cwd=ROOT, input=session, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.count("answer: ") == 3
    assert out.count("latency: ") == 3


def test_cli_reports_an_unreachable_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        done = subprocess.run([sys.executable, "client.py", "--port", str(port), "--question", "a",
                               "--context", "b"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 2 and "cannot connect" in done.stderr


@pytest.mark.parametrize("peer", ["silent", "closing"])
def test_cli_reports_a_server_that_never_answers_or_hangs_up_without_a_traceback(
        peer: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        done = subprocess.Popen([sys.executable, "client.py", "--port", str(port), "--question",
                                 "Who?", "--context", "Bob.", "--timeout", "1"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        conn, _ = listener.accept()
        if peer == "closing":
            conn.close()
        _, stderr = done.communicate(timeout=60)
        conn.close()
    assert "Traceback" not in stderr, stderr
    if peer == "silent":
        assert done.returncode == 1 and "no reply from" in stderr and "--timeout 1 s" in stderr
    else:
        assert done.returncode == 2 and "closed" in stderr, stderr


def test_a_timeout_covers_sending_to_a_server_that_never_reads() -> None:
    """Each call returns within its timeout: TimeoutError while the socket takes nothing more,
    then ConnectionLost once a request was cut off part-way (it used to block in sendall)."""
    outcomes: list[str] = []

    def calls(port: int) -> None:
        client = Client("127.0.0.1", port)
        for _ in range(10):
            try:
                client.answer("Who?", "word " * 150_000, timeout=0.3)  # 750 KB each
            except TimeoutError:
                outcomes.append("timeout")
            except ConnectionLost:
                outcomes.append("lost")
        client._reader.join(timeout=3)  # the cut-off shut the socket: its reader woke and ended
        outcomes.append("reader alive" if client._reader.is_alive() else "reader ended")
        client.close()

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        caller = threading.Thread(target=calls, args=(listener.getsockname()[1],), daemon=True)
        caller.start()
        caller.join(timeout=60)
        assert not caller.is_alive(), f"a call blocked past its timeout after {outcomes}"
    assert outcomes[0] == "timeout" and outcomes[-2:] == ["lost", "reader ended"], outcomes


def test_stress_test_runs_client_processes_and_reports_every_request(
        server: InferenceServer) -> None:
    host, port = server.address
    done = subprocess.run(
        [sys.executable, "stress_test.py", "--host", host, "--port", str(port),
         "--num_simultaneous_clients", "3", "--num_total_clients", "6",
         "--num_request_per_client", "4", "--warmup", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "requests: 24   ok: 24   errors: none" in done.stdout
    assert "p99" in done.stdout and "requests/s" in done.stdout


def test_a_timed_out_wait_tells_the_server_the_deadline_and_forgets_the_request() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = Client(*listener.getsockname()[:2])
    peer, _ = listener.accept()
    with pytest.raises(TimeoutError):
        client.answer("Who?", "Bob.", timeout=0.2)  # the fake server never answers
    assert client.in_flight == 0  # nothing left behind waiting forever
    decoder = FrameDecoder()
    decoder.receive_data(peer.recv(4096))
    assert decoder.next_message()["timeout_ms"] == 200
    peer.close()
    client.close()
    listener.close()


def test_ready_probe_exits_zero_for_a_ready_server_and_two_when_unreachable(
        server: InferenceServer) -> None:
    host, port = server.address
    ready = subprocess.run([sys.executable, "client.py", "--host", host, "--port", str(port),
                            "--ready"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ready.returncode == 0 and "'ready': True" in ready.stdout
    probe = socket.create_server(("127.0.0.1", 0))
    free_port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    gone = subprocess.run([sys.executable, "client.py", "--port", str(free_port), "--ready"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 2


def test_the_address_file_exists_exactly_while_serving_and_the_probe_reads_it(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    address_file = tmp_path / "server.address"
    address_file.write_text("127.0.0.1:1\n")  # left by an earlier run that was killed
    probe = [sys.executable, "client.py", "--address_file", str(address_file), "--ready"]
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          address_file=str(address_file))
    with InferenceServer(config) as srv:
        assert address_file.read_text() == f"127.0.0.1:{srv.address[1]}\n"
        ready = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert ready.returncode == 0 and "'ready': True" in ready.stdout
    assert not address_file.exists()
    gone = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 2 and str(address_file) in gone.stderr


def test_the_docker_health_check_probes_the_address_the_server_writes() -> None:
    dockerfile = (ROOT / "docker" / "server.Dockerfile").read_text()
    entrypoint = next(line for line in dockerfile.splitlines() if line.startswith("ENTRYPOINT"))
    check = dockerfile[dockerfile.index("HEALTHCHECK"):].splitlines()[1]
    written = entrypoint.split('"--address_file", "')[1].split('"')[0]
    assert f'"--address_file", "{written}"' in check and '"--ready"' in check
    assert "--port" not in check  # it follows whatever --port the container was given


# what each image's programs import, the engines and the broker roles (imported only when
# chosen), prepare_model.py and the health check's client.py
SERVER_MODULES = ("server, client, workers.worker_main, prepare_model, engines.onnx_engine, "
                  "engines.torch_engine, engines.zero_engine, preparation.fp16, "
                  "preparation.export, broker.frontend, broker.worker")


@pytest.mark.parametrize("image,modules", [("server", SERVER_MODULES), ("client", "client")])
def test_each_image_copies_every_file_its_program_imports(image: str, modules: str) -> None:
    dockerfile = (ROOT / "docker" / f"{image}.Dockerfile").read_text()
    sources = [word for line in dockerfile.splitlines() if line.startswith("COPY ")
               for word in line.split()[1:-1]]
    listing = (f"import sys, {modules}; print('\\n'.join(m.__file__ for m in "
               "list(sys.modules.values()) if getattr(m, '__file__', None)))")
    files = subprocess.run([sys.executable, "-c", listing], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, check=True).stdout.split()
    ours = {Path(f).resolve().relative_to(ROOT).as_posix() for f in files
            if Path(f).is_absolute() and Path(f).resolve().is_relative_to(ROOT)
            and ".venv" not in Path(f).parts}  # (torch names some modules by a bare file name)
    missing = [f for f in sorted(ours)
               if not any(f == s or (s.endswith("/") and f.startswith(s)) for s in sources)]
    assert ours and not missing, f"not copied into the {image} image: {missing}"


def test_repl_reconnects_after_the_server_closed_its_idle_connection(tiny_model_dir: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          idle_timeout_s=0.5)
    with InferenceServer(config) as srv:
        host, port = srv.address
        repl = subprocess.Popen([sys.executable, "client.py", "--host", host, "--port", str(port)],
                                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        assert repl.stdin is not None
        repl.stdin.write(f"{CONTEXTS[0]}\n{QUESTIONS[0]}\n")
        repl.stdin.flush()
        wait_until(lambda: srv.stats.snapshot()["events"]["idle_timeout"] == 1, timeout=60)
        out, _ = repl.communicate(f"{QUESTIONS[1]}\n", timeout=60)  # asked after the close
        assert repl.returncode == 0
        assert out.count("answer: ") == 2 and "error" not in out and "lost" not in out


def test_the_client_needs_msgpack_alone_as_in_its_docker_image() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, client; print(' '.join(sorted(sys.modules)))"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    heavy = {"numpy", "torch", "onnxruntime", "tokenizers", "transformers", "engines"}
    assert "msgpack" in loaded and not heavy & set(loaded)
