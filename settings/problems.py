"""The checks of a ``ServerConfig``: what makes settings unable to serve, each said as the
usage error that names its flags (``ServerConfig.problems``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from settings.server_config import ServerConfig


def config_problems(config: ServerConfig, flags: dict[str, str]) -> list[str]:
    """What is wrong with these settings (empty when they can serve); ``flags``: each
    setting's flag, by name (``setting_flags()``)."""
    at_least_one = ("num_inference_sessions", "workers", "max_batch_size", "batch_lookahead",
                    "max_queue", "max_connections", "max_frame_size")
    never_negative = ("claim_idle_ms", "sim_scale", "threads_per_session",
                      "max_batch_tokens",
                      "max_queue_delay_ms", "request_timeout_ms", "idle_timeout_s",
                      "frame_timeout_s", "auth_timeout_s",
                      "max_question_chars", "max_context_chars", "max_texts",
                      "shutdown_timeout_s")
    return ([f"{flags[name]} must be at least 1" for name in at_least_one
             if getattr(config, name) < 1]
            + [f"{flags[name]} must not be negative" for name in never_negative
               if getattr(config, name) < 0]
            + ([] if config.send_timeout_s >= 0.001 else ["--send_timeout must be at least "
                                                          "0.001 (0 would mean never)"])
            + ([] if config.max_outbox_mb >= 1 else ["--max_outbox_mb must be at least 1"])
            + _device_problems(config) + _broker_problems(config)
            + _transport_problems(config) + _auth_problems(config))


def _device_problems(config: ServerConfig) -> list[str]:
    problems = []
    for parse in (config.gpu_indices, config.bucket_lengths):
        try:
            parse()
        except ValueError as exc:
            problems.append(str(exc))
    if not problems and any(n > config.max_seq_len for n in config.bucket_lengths()):
        problems.append(f"--length_buckets must not exceed --max_seq_len {config.max_seq_len}")
    return problems


def _broker_problems(config: ServerConfig) -> list[str]:
    if config.models is not None and config.role != "worker":
        return ["--models applies to --role worker (a front end serves every model of "
                "--model_dir; requests name theirs)"]
    if config.broker is None:
        return ["--role worker needs --broker"] if config.role == "worker" else []
    if config.workers > 1:  # the URL itself: broker/urls.py's check, through the registry
        return ["--workers applies without --broker; with one, start more --role worker "
                "processes instead"]
    if config.executors == "on":
        return ["--executors on applies without --broker (each --role worker owns its "
                "engine)"]
    return []


def _auth_problems(config: ServerConfig) -> list[str]:
    if config.auth_token_file is None:
        return []
    from settings.tokens import TokenFileError, read_tokens

    try:
        read_tokens(config.auth_token_file)
    except TokenFileError as exc:
        return [f"--auth_token_file: {exc}"]
    return []


def _transport_problems(config: ServerConfig) -> list[str]:
    problems = []
    if not -1 <= config.port <= 65535:
        problems.append("--port must be -1 (no TCP), 0 (any free port) or a port number")
    if config.port == -1 and not config.unix_socket:
        problems.append("--port -1 serves no TCP: give --unix_socket to serve on")
    if config.unix_socket is not None and not 0 < len(os.fsencode(config.unix_socket)) <= 107:
        problems.append("--unix_socket must be a path of 1 to 107 bytes")
    if config.http_port is not None and not -1 <= config.http_port <= 65535:
        problems.append("--http_port must be -1 (no HTTP), 0 (any free port) or a port number")
    if config.http_payload_limit < 1024:
        problems.append("--http_payload_limit must be at least 1024 bytes")
    if config.tls_handshake_timeout_s <= 0:
        problems.append("--tls_handshake_timeout must be positive")
    if config.role == "worker" and (config.unix_socket or config.tls_cert):
        problems.append("--unix_socket and --tls_cert apply to a listener; --role worker "
                        "has none")
    return problems + _tls_problems(config)


def _tls_problems(config: ServerConfig) -> list[str]:
    if config.tls_cert is None and config.tls_key is None:
        return ["--tls_client_ca needs --tls_cert and --tls_key"] \
            if config.tls_client_ca is not None else []
    if config.tls_cert is None or config.tls_key is None:
        return ["--tls_cert and --tls_key go together"]
    if config.port == -1 and config.http_address() is None:
        return ["--tls_cert applies to TCP and HTTP, and --port -1 --http_port -1 serve "
                "neither (the Unix socket never uses TLS)"]
    named = {"--tls_cert": config.tls_cert, "--tls_key": config.tls_key,
             "--tls_client_ca": config.tls_client_ca}
    # whether they load as a TLS context: transport/tls.py's check, through the registry
    return [f"{flag}: cannot read {path}" for flag, path in named.items()
            if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK))]

