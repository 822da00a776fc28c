"""How the tasks call the tokenizer: one call for a request's texts, with the GIL released or not.

``encode_batch`` releases the GIL while it runs, so in a process whose threads tokenize side by
side (the in-process server's connection threads, a Redis front end's) a context's encode runs
on one core while the other threads frame, plan, decode and reply on the others. A worker
process has one thread that tokenizes; there releasing the GIL only adds hand-offs with its
session thread, measured at about 5% more CPU per request on a loaded 2-core machine
(docs/benchmarks.md), so workers/worker_main.py turns it off, except beside an engine that takes
the GIL back more than once per run (PyTorch, engines.GIL_RETAKING): each take-back would wait
behind a whole encode.
Either way the encodings are the same, and the tokenizers library's own thread pool is off
unless the user set it: for a call this small it only adds hand-offs (two texts cost 30% more
CPU through it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tokenizers import Encoding, Tokenizer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_release_gil = True


def release_gil(enabled: bool) -> None:
    """Whether this process's encodes release the GIL (default True)."""
    global _release_gil
    _release_gil = enabled


def releases_gil() -> bool:
    """Whether this process's encodes release the GIL."""
    return _release_gil


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str], **options: Any) -> list[Encoding]:
    """One encoding per text, in order (``options`` as for ``Tokenizer.encode``)."""
    if _release_gil:
        return tokenizer.encode_batch(list(texts), **options)
    return [tokenizer.encode(text, **options) for text in texts]
