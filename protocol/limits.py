"""Caps on the text of a model request, checked before any tokenizing: one oversized request
fails alone, with a message naming the option that sets the cap."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import BadRequest
from protocol.messages import ClassifyRequest, EmbedRequest, ModelRequest, QARequest


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldLimits:
    """Caps in characters (Unicode code points) and texts per request; 0 means no cap.

    The names are the server options that set them, and the error message names the option.
    """

    max_question_chars: int = 1_000
    max_context_chars: int = 100_000
    max_texts: int = 256

    def check(self, request: ModelRequest) -> None:
        """Raise BadRequest naming the limit if ``request`` has a field over its cap
        (a plug-in task's fields are its own to check)."""
        if isinstance(request, QARequest):
            self._chars(request.id, "question", request.question, "max_question_chars")
            self._chars(request.id, "context", request.context, "max_context_chars")
        elif isinstance(request, ClassifyRequest):
            self._chars(request.id, "text", request.text, "max_context_chars")
        elif isinstance(request, EmbedRequest):
            if self.max_texts and len(request.texts) > self.max_texts:
                raise BadRequest(f"field 'texts' has {len(request.texts)} texts; the limit is "
                                 f"{self.max_texts} (max_texts)", request_id=request.id)
            for index, text in enumerate(request.texts):
                self._chars(request.id, f"texts[{index}]", text, "max_context_chars")

    def _chars(self, request_id: int, name: str, text: str, option: str) -> None:
        limit = getattr(self, option)
        if limit and len(text) > limit:
            raise BadRequest(f"field {name!r} has {len(text)} characters; the limit is {limit} "
                             f"({option})", request_id=request_id)
