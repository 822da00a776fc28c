"""The server's settings: one ``ServerConfig`` field per setting, and its command-line flag.

Each field carries its flag's help, so the CLI and the config cannot drift apart; every setting
is explained in docs/operations.md. The allowed values of settings an implementation owns, and
the checks only an implementation can make (a TLS context, a broker URL), come from the
``SettingRegistry`` the caller passes (settings/choices.py): settings/ imports no implementation.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from protocol import DEFAULT_MAX_FRAME_SIZE
from protocol.limits import FieldLimits
from settings.choices import OWNED, Owned, SettingRegistry
from settings.cli import HelpFormatter
from settings.config_file import (
    CONFIG_FLAG,
    ConfigFileError,
    config_file_named,
    with_config_file,
)
from settings.problems import config_problems


#: The HTTP API's port unless --http_port says else (Triton's and vLLM's too).
DEFAULT_HTTP_PORT = 8000


def option(default: Any, help: str, *, flag: str | None = None,
           choices: tuple[str, ...] | Owned | None = None) -> Any:
    """A ServerConfig field and its command-line flag (``--NAME`` unless ``flag`` says else).
    ``choices``: its allowed values, or ``OWNED`` where the registry's owner gives them."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


@dataclass(kw_only=True)
class ServerConfig:
    """Every serving setting; each field is also the CLI flag of the same name (docs/operations.md)."""

    host: str = option("127.0.0.1", "address to bind (0.0.0.0: all interfaces)")
    port: int = option(9999, "TCP port (0: any free port; -1: no TCP, serve --unix_socket only)")
    unix_socket: str | None = option(None, "also serve on a Unix socket at this path (mode from "
                                     "the umask; a stale file left by a dead server is "
                                     "replaced; never TLS)")
    http_port: int | None = option(None, "HTTP/JSON API port beside TCP (docs/http.md; "
                                   "default 8000, or any free port where --port is 0; 0: any "
                                   "free port; -1: no HTTP)")
    http_host: str | None = option(None, "address the HTTP API binds (default: --host)")
    http_payload_limit: int = option(2_000_000, "largest HTTP request body, bytes (a larger "
                                     "one is refused 413 before it is read)")
    tls_cert: str | None = option(None, "PEM certificate (chain): serve TCP, and the HTTP API, "
                                  "over TLS 1.2+ (needs --tls_key)")
    tls_key: str | None = option(None, "PEM private key of --tls_cert (unencrypted)")
    tls_client_ca: str | None = option(None, "PEM CA certificates: every TLS client must "
                                       "present a certificate one of them signed")
    tls_handshake_timeout_s: float = option(10.0, "seconds a TLS client may take to complete "
                                            "its handshake before it is closed",
                                            flag="--tls_handshake_timeout")
    num_inference_sessions: int = option(2, "inference-session threads, each with its own engine "
                                         "(per worker process, with --workers above 1)")
    workers: int = option(1, "processes that tokenize, batch and run the model (1: all in the "
                          "server's own process; N: a front-end process and N workers pulling "
                          "from its queue, docs/architecture.md)")
    executors: str = option("off", "on: each device's engine runs in one executor process of "
                            "its own, which batches the tokenized rows of every worker "
                            "(--workers N tokenize and decode); off: each worker owns its "
                            "engines (docs/architecture.md)", choices=("off", "on"))
    executor_overlap: str = option("on", "with --executors on: on forms the next batch and "
                                   "copies its inputs in while the device runs this one (on "
                                   "engines that can: PyTorch's CUDA graphs, the sim engine); "
                                   "off runs one batch at a time", choices=("on", "off"))
    cuda_devices: str | None = option(None, "GPUs for the workers, e.g. 0,1: worker i runs on "
                                      "cuda:<the (i mod count)-th of them> (overrides --device)")
    broker: str | None = option(None, "redis://[:PASSWORD@]HOST:PORT/DB (rediss:// for TLS): "
                                "this process is a front end that puts work on Redis for "
                                "--role worker processes anywhere (docs/scaling.md)")
    role: str = option("server", "server: listen for clients (a front end with --broker); "
                       "worker: no listener, run the model for front ends, pulling work from "
                       "--broker", choices=("server", "worker"))
    broker_prefix: str = option("qa", "prefix of every Redis key of this deployment")
    models: str | None = option(None, "--role worker: the models of --model_dir this worker "
                                "holds, e.g. qa,embed (default: all of them)")
    claim_idle_ms: float = option(15000.0, "a worker claims work another worker took and left "
                                  "unanswered this long (it died): the visibility timeout")
    inference_engine_type: str = option("onnx", "engine backend; not given (nor in --config), "
                                        "a GPU box, where PyTorch sees a CUDA device, gets "
                                        "pytorch at fp16 (unless --precision), else onnx "
                                        "(docs/gpu.md) (zero: no model, random answers; for "
                                        "front-end benchmarks only; sim: random answers at a "
                                        "simulated GPU's cost, for tests and benchmarks of the "
                                        "GPU layout)", choices=OWNED)
    sim_cost_curve: str | None = option(None, "sim engine: the GPU cost curve it follows, a "
                                        "file the GPU check wrote (default: one H200's, "
                                        "engines/data/cost_curve_h200.json)")
    sim_scale: float = option(0.0, "sim engine: the device's speed against the GPU measured "
                              "(0: as fast against this machine's cores as that GPU was "
                              "against its machine's, e.g. 2/16 on 2 cores)")
    sim_host: str = option("on", "sim engine: on spends each run's host parts (padding, "
                           "copies, launch, unpacking; engines/sim_host.py) on the host, GIL "
                           "held where the real engine holds it, and the rest of its time on "
                           "the device; off spends all of it on the device",
                           choices=("on", "off"))
    sim_device_dir: str | None = option(None, "sim engine: the folder of the simulated devices' "
                                        "files, which every process of the server shares "
                                        "(default: a new temporary folder per server)")
    model_dir: str = option("saved_models", "a folder written by prepare_model.py, or a "
                            "repository: each subfolder holding one is a model of that name, "
                            "all served at once (docs/tasks.md)")
    device: str = option("auto", "auto, cpu, cuda or cuda:N (auto: GPU if any)")
    precision: str = option("fp32", "engine arithmetic (a GPU box's automatic pytorch: fp16, "
                            "or fp32 where prepare_model.py found fp16 disagreeing): fp16 runs "
                            "model_fp16.onnx "
                            "(prepare_model.py --fp16) or float16 PyTorch on CUDA; bf16 runs "
                            "bfloat16 PyTorch; where it cannot, the server says so and runs fp32",
                            choices=OWNED)
    pytorch_graph: str = option("auto", "pytorch engine: traced runs the model as one "
                                "TorchScript graph, which holds no GIL between operators "
                                "(checked against eager at load; eager where that fails); "
                                "cudagraphs captures that graph as one CUDA graph per batch "
                                "shape (rows 1-64 x --length_buckets, else 64,128,256,384; "
                                "traced where it cannot, or for a larger batch); eager runs it "
                                "operator by operator; auto: cudagraphs on CUDA, else traced",
                                choices=OWNED)
    onnx_cuda_graphs: str = option("off", "onnx engine on CUDA: on replays the model as one "
                                   "CUDA graph per batch shape, as --pytorch_graph cudagraphs "
                                   "does (without them where they cannot be captured, said in "
                                   "the log); off until measured faster on a GPU (docs/gpu.md)",
                                   choices=("off", "on"))
    cpu_scheduling: str = option("batch", "Linux CPU scheduling policy of server.py and its "
                                 "worker processes: batch (SCHED_BATCH) lets a thread that "
                                 "wakes wait for a busy core's time slice instead of "
                                 "preempting it (less switching under load, the same on an "
                                 "idle machine); normal leaves the default (docs/operations.md)",
                                 choices=OWNED)
    threads_per_session: int = option(0, "CPU threads per session's batch (0: cores divided "
                                      "among sessions)")
    batching: str = option("auto", "auto: batch only as far as the measured cost says it pays; "
                           "fixed: fill up to the caps; off: one request per batch",
                           choices=OWNED)
    max_batch_size: int = option(32, "most requests a session runs as one batch")
    length_buckets: str | None = option(None, "pad every batch to the next of these lengths, "
                                        "e.g. 64,128,256,384 (--max_seq_len is always the "
                                        "last): few shapes for TensorRT, which builds per "
                                        "shape; on a CPU the padding only costs")
    max_batch_tokens: int = option(16384, "most rows x padded length in one batch (a larger "
                                   "request runs alone)")
    max_queue_delay_ms: float = option(2.0, "most a request waits for a bigger batch (only spent "
                                       "when it can help)")
    batch_lookahead: int = option(128, "waiting requests considered when forming a batch")
    max_queue: int = option(1024, "requests waiting at most; more get 'overloaded' at once")
    request_timeout_ms: float = option(30000.0, "default deadline of a request, from admission; "
                                       "past it a queued request gets 'deadline_exceeded' and is "
                                       "never run (0: none; a request's timeout_ms overrides)")
    max_connections: int = option(1024, "concurrent connections; more get "
                                  "'too_many_connections' and are closed")
    idle_timeout_s: float = option(300.0, "close a connection that sent nothing and awaits no "
                                   "reply for this many seconds (0: never)", flag="--idle_timeout")
    frame_timeout_s: float = option(30.0, "seconds a frame may take to arrive once begun "
                                    "(slowloris guard; 0: no limit)", flag="--frame_timeout")
    max_frame_size: int = option(DEFAULT_MAX_FRAME_SIZE, "frame cap, bytes")
    max_question_chars: int = option(1000, "longest question, characters (0: no cap)")
    max_context_chars: int = option(100_000, "longest context, or text to embed or classify, "
                                    "characters (0: no cap)")
    max_texts: int = option(256, "most texts in one embed request (0: no cap)")
    send_timeout_s: float = option(30.0, "seconds replies may stay unsent to a client that does "
                                   "not read before it is disconnected", flag="--send_timeout")
    max_outbox_mb: float = option(32.0, "MiB of replies a client may leave unread (its requests "
                                  "already admitted, e.g. large embed replies) before it is "
                                  "disconnected; at least 1")
    no_answer: str = option("auto", "SQuAD2 'no answer' (auto: on for SQuAD2 models)",
                            choices=("auto", "on", "off"))
    max_seq_len: int = option(384, "tokens per QA window, or per text to embed or classify "
                              "(longer texts are cut); capped by each model")
    doc_stride: int = option(128, "tokens shared by neighbouring windows of a long context")
    max_answer_len: int = option(15, "longest answer, tokens")
    shutdown_timeout_s: float = option(30.0, "seconds to finish admitted work on stop",
                                       flag="--shutdown_timeout")
    metrics_port: int | None = option(None, "serve Prometheus metrics at "
                                      "http://HOST:PORT/metrics")
    metrics_host: str = option("127.0.0.1", "address for --metrics_port")
    auth_token_file: str | None = option(None, "require token authentication: each "
                                         "connection's first request must be 'auth' with one "
                                         "of the tokens in this file (one per line; blank lines "
                                         "and # comments ignored; read at start)")
    auth_timeout_s: float = option(5.0, "seconds a connection has to authenticate, with "
                                   "--auth_token_file, before it is closed (0: no limit but "
                                   "--idle_timeout)", flag="--auth_timeout")
    address_file: str | None = option(None, "write HOST:PORT to this file once serving, and "
                                      "remove it on stop: for health checks (client.py "
                                      "--address_file) and to learn what --port 0 chose")

    def engine_threads(self) -> int:
        """Threads per engine (per session's runs): as configured, else the machine's cores
        shared among every session of every worker, so that batches running side by side do
        not oversubscribe the cores."""
        if self.threads_per_session > 0:
            return self.threads_per_session
        engines = max(1, self.num_inference_sessions) * max(1, self.workers)
        return max(1, (os.cpu_count() or 1) // engines)

    def worker_window(self) -> int:
        """Most requests the front end hands one worker process at once (one batch running,
        the next one forming); a worker's own queue holds at least this many."""
        return max(2, 2 * self.max_batch_size)

    def lone_threads(self) -> int:
        """Threads for a batch that has the machine to itself (every core), where the cores are
        shared out among the sessions of one process; 0 where they are not (set explicitly, or
        split over worker processes, or one session has them all anyway)."""
        cores = os.cpu_count() or 1
        if self.threads_per_session > 0 or self.workers > 1 or self.engine_threads() >= cores:
            return 0
        return cores

    def gpu_indices(self) -> list[int]:
        """The GPU indices of ``--cuda_devices`` (empty when not given).

        Raises:
            ValueError: not a comma-separated list of non-negative integers.
        """
        if self.cuda_devices is None:
            return []
        parts = [part.strip() for part in self.cuda_devices.split(",")]
        if not parts or not all(part.isdigit() for part in parts):
            raise ValueError(f"--cuda_devices must list GPU indices like 0,1; got "
                             f"{self.cuda_devices!r}")
        return [int(part) for part in parts]

    def bucket_lengths(self) -> tuple[int, ...]:
        """The lengths of ``--length_buckets``, ascending (empty when not given).

        Raises:
            ValueError: not a comma-separated list of positive integers.
        """
        if self.length_buckets is None:
            return ()
        parts = [part.strip() for part in self.length_buckets.split(",")]
        if not all(part.isdigit() and int(part) > 0 for part in parts):
            raise ValueError(f"--length_buckets must list token counts like 64,128,256,384; got "
                             f"{self.length_buckets!r}")
        return tuple(sorted({int(part) for part in parts}))

    def worker_devices(self) -> list[str]:
        """The device of each worker (of the one in-process backend when ``workers`` is 1):
        ``--cuda_devices`` round-robin, else ``--device`` for all."""
        gpus = self.gpu_indices()
        return [f"cuda:{gpus[i % len(gpus)]}" if gpus else self.device
                for i in range(max(1, self.workers))]

    def problems(self) -> list[str]:
        """What is wrong with these settings (empty when they can serve)."""
        return config_problems(self, setting_flags())

    def http_address(self) -> tuple[str, int] | None:
        """Where the HTTP API listens: (host, port), port 0 for any free one; None: no HTTP
        (``--http_port -1``, or a ``--role worker``, which has no listener)."""
        if self.role == "worker" or self.http_port == -1:
            return None
        port = self.http_port if self.http_port is not None else \
            (0 if self.port == 0 else DEFAULT_HTTP_PORT)
        return (self.http_host or self.host), port

    def limits(self) -> FieldLimits:
        """The caps on request fields."""
        return FieldLimits(max_question_chars=self.max_question_chars,
                           max_context_chars=self.max_context_chars, max_texts=self.max_texts)


def setting_flags() -> dict[str, str]:
    """Each setting's flag (``--NAME`` unless its field says else), by the setting's name, in
    ServerConfig's order."""
    return {f.name: f.metadata["flag"] or f"--{f.name}" for f in fields(ServerConfig)}


_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "int | None": int,
                           "str | None": str}


def build_parser(description: str | None,
                 registry: SettingRegistry) -> argparse.ArgumentParser:
    """An argument parser with one flag per ServerConfig field, each showing its default; the
    owned settings' choices come from ``registry``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    flags = setting_flags()
    for f in fields(ServerConfig):
        meta = f.metadata
        choices = registry.allowed(f.name) if meta["choices"] is OWNED else meta["choices"]
        parser.add_argument(flags[f.name], dest=f.name,
                            type=_TYPES[str(f.type)], default=f.default, choices=choices,
                            help=meta["help"])
    return parser


def parse_args(description: str | None, argv: list[str] | None = None, *,
               registry: SettingRegistry) -> ServerConfig:
    """Command-line options (and a ``--config`` file's, under them) -> ServerConfig (one flag
    per config field); sets up logging."""
    parser = full_parser(description, registry)
    given = sys.argv[1:] if argv is None else argv
    try:
        argv = with_config_file(given, flags_of(parser))
    except ConfigFileError as exc:
        parser.error(str(exc))
    args = vars(parser.parse_args(argv))
    args.pop("config")
    config_file = config_file_named(given)
    configure_logging(args.pop("log_level"))
    if config_file is not None:
        logging.getLogger("server").info("settings read from %s (flags given beside it win)",
                                         config_file)
    return config_from_args(parser, args, registry)


def configure_logging(level: str | int, process: str = "") -> None:
    """The log's format: time, level, ``process`` (a worker's name), logger and message; at
    DEBUG the milliseconds and the thread's name too."""
    detail = level in ("DEBUG", logging.DEBUG)
    where = f"{process} " if process else ""
    thread = "%(threadName)s " if detail else ""
    logging.basicConfig(level=level, datefmt=None if detail else "%Y-%m-%d %H:%M:%S",
                        format=f"%(asctime)s %(levelname)s {where}{thread}%(name)s: %(message)s")


def full_parser(description: str | None, registry: SettingRegistry) -> argparse.ArgumentParser:
    """``build_parser``'s, with ``--log_level`` and ``--config``."""
    parser = build_parser(description, registry)
    parser.add_argument("--log_level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log detail")
    parser.add_argument(CONFIG_FLAG, metavar="FILE", help="settings from a TOML file of "
                        "name = value lines, the names flags without their dashes (what qa-tune "
                        "--out writes); flags given here win over it")
    return parser


def given_settings(argv: list[str] | None, registry: SettingRegistry) -> set[str]:
    """The settings the command line ``argv`` (default: this process's) gives a value, by
    their names, a ``--config`` file's included: what the server must not choose for itself."""
    parser = full_parser(None, registry)
    for action in parser._actions:  # no defaults: only what the command line gives is set
        action.default = argparse.SUPPRESS
    try:  # parse_args has refused a bad file already
        argv = with_config_file(sys.argv[1:] if argv is None else argv, flags_of(parser))
    except ConfigFileError:
        argv = []
    known, _ = parser.parse_known_args(argv)
    return set(vars(known)) & {f.name for f in fields(ServerConfig)}


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    """Every long flag ``parser`` takes."""
    return {flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--")}


def config_from_args(parser: argparse.ArgumentParser, args: dict[str, Any],
                     registry: SettingRegistry) -> ServerConfig:
    """The ServerConfig of parsed flags; impossible values are a usage error naming the flags
    (settings' own checks first, then the registry's, which need the settings to be sound)."""
    config = ServerConfig(**args)
    if problems := config.problems() or registry.problems(config):
        parser.error("; ".join(problems))
    return config
