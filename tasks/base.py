"""The task contract: what turns one kind of request into engine rows and engine outputs back
into one answer. The server knows tasks only through it (docs/tasks.md shows how to add one).

A task is built once per served model (``load_task``) and then used from many threads at once:
``features`` on connection threads, ``collate``, ``split_outputs`` and ``postprocess`` on session
threads. It must not change after it is built.

The path of one request::

    features(request)         on the connection's thread, before the queue: a bad request fails
                              alone, with BadRequest
    collate(batch)            on a session thread: the batch's engine inputs
    engine.run(feeds)
    split_outputs(batch, out) one tuple of arrays per request (ValueError: the batch fails)
    postprocess(f, *arrays)   one answer (a map); an exception fails this request only:
                              a ServerError as itself (EngineError for outputs holding NaN or
                              an infinity), anything else as an internal error
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from protocol.errors import EngineError, InternalError, ServerError

if TYPE_CHECKING:
    from engines.model_dir import ModelInfo
    from settings.server_config import ServerConfig

log = logging.getLogger(__name__)


class Features(Protocol):
    """One request's engine rows, as the queue and the batch planner see them."""

    @property
    def rows(self) -> int:
        """Engine rows this request takes in a batch (QA windows, texts to embed)."""

    @property
    def max_len(self) -> int:
        """Tokens in its longest row."""


class Task(Protocol):
    """What a served model's task provides.

    Attributes:
        name: The task's name in serving.json (``qa``, ``embed``, ``classify``).
        op: The request op it answers.
        fields: Its request fields and what each must be, for the ``models`` op.
        input_names: The engine inputs ``collate`` produces, in order.
        output_names: The engine outputs ``split_outputs`` reads.
        buckets: Lengths batches are padded to (empty: to the longest row).
        max_seq_len: The longest row it makes.
    """

    name: ClassVar[str]
    op: ClassVar[str]
    fields: ClassVar[Mapping[str, str]]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    buckets: tuple[int, ...]
    max_seq_len: int

    @classmethod
    def from_model(cls, model_dir: str | Path, info: ModelInfo, config: ServerConfig) -> Task:
        """Build the task of a prepared model folder under the server's settings (once per
        model, in each process that serves it)."""

    def features(self, request: Any) -> Features:
        """Validate and tokenize one request (a protocol request of ``op``).

        Raises:
            BadRequest: what the model cannot take.
        """

    def padded_length(self, length: int) -> int:
        """The length a batch whose longest row has ``length`` tokens is padded to."""

    def collate(self, batch: Sequence[Any]) -> dict[str, np.ndarray]:
        """The batch's engine inputs, one array per name in ``input_names``."""

    def split_outputs(self, batch: Sequence[Any],
                      outputs: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, ...]]:
        """One tuple of arrays per request, in batch order.

        Raises:
            ValueError: an output is missing or has the wrong number of rows.
        """

    def postprocess(self, features: Any, *outputs: np.ndarray) -> dict[str, Any]:
        """One request's answer, as the reply's ``result`` map."""


def non_finite(name: str) -> EngineError:
    """The error for an engine output that holds NaN or an infinity where it matters to this
    request's answer (a numeric overflow, e.g. of an fp16 engine): the engine's fault, typed as
    such, rather than a wrong answer or a failure deeper in the decoding."""
    return EngineError(f"the engine's {name} for this request hold NaN or infinite values")


def check_finite(values: np.ndarray, name: str) -> None:
    """Raise ``non_finite(name)`` unless every value is finite."""
    if not np.isfinite(values).all():
        raise non_finite(name)


class Postprocessing(Protocol):
    """What ``answer_of`` needs of a task (every Task has it)."""

    def postprocess(self, features: Any, *outputs: Any) -> dict[str, Any]: ...


def answer_of(task: Postprocessing, features: Any, outputs: Sequence[Any],
              where: str) -> tuple[dict[str, Any] | None, ServerError | None]:
    """``task.postprocess`` of one request: ``(result, None)``, or ``(None, error)`` when it
    fails, logged under ``where`` (the session, or the broker's front end): a ServerError as
    raised, any other exception as an InternalError."""
    try:
        return task.postprocess(features, *outputs), None
    except ServerError as exc:
        log.warning("%s: %s", where, exc.message)
        return None, exc
    except Exception as exc:  # noqa: BLE001 - one bad answer fails alone
        log.exception("%s: postprocessing failed", where)
        return None, InternalError(f"postprocessing failed: {type(exc).__name__}")
