"""Checking a server's answers against the model's own (the reference: each request of the mix
run alone through the task in-process, ``bench.raw.reference_answers``): a reply agrees with it
when every field it has matches, numbers to within what batching, padding and half precision
change.

A load run given the reference (``run_closed_loop(..., expected=...)``) counts a reply that
disagrees as the error ``wrong_answer``, so a configuration that answers fast but wrongly
never wins a tuning trial (tune.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: The error code a reply that disagrees with the reference is counted under.
WRONG_ANSWER = "wrong_answer"
#: Numbers agree within ABS_TOL + REL_TOL x |reference| (fp16 moves a probability by ~1e-3).
ABS_TOL = 2e-3
REL_TOL = 1e-2
#: Two answers tie when their scores are this close, relatively: either is the model's.
TIE_REL_TOL = 1e-2


def wrong_answer(expected: Sequence[Any] | None, index: int, reply: Any) -> str | None:
    """``WRONG_ANSWER`` when ``reply`` disagrees with the reference of mix item ``index``;
    None when it agrees, or when there is no reference."""
    if expected is None or agrees(expected[index % len(expected)], reply):
        return None
    return WRONG_ANSWER


def agrees(expected: Any, got: Any) -> bool:
    """Whether ``got`` carries ``expected``: every key of a map (others may be added), every item
    of a list, strings and booleans equal, numbers close. Two QA answers or class labels whose
    ``score`` ties (within ``TIE_REL_TOL`` of each other) agree whatever their spans or labels:
    the model cannot tell them apart, and fp16 may break the tie either way."""
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping):
            return False
        if _tie(expected, got):
            return True
        return all(key in got and agrees(value, got[key]) for key, value in expected.items())
    if isinstance(expected, list | tuple):
        return isinstance(got, list | tuple) and len(got) == len(expected) and \
            all(agrees(e, g) for e, g in zip(expected, got, strict=True))
    if isinstance(expected, bool) or not isinstance(expected, int | float):
        return bool(expected == got)
    return isinstance(got, int | float) and not isinstance(got, bool) and \
        math.isclose(got, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def _tie(expected: Mapping[str, Any], got: Mapping[str, Any]) -> bool:
    """Two answers (a QA span's ``answer`` or a class ``label``, each with its ``score``, every
    field there) whose scores are relatively this close: a tie."""
    scores = expected.get("score"), got.get("score")
    if not ("answer" in expected or "label" in expected) or \
            not all(isinstance(s, float) for s in scores) or not set(expected) <= set(got):
        return False
    return math.isclose(scores[0], scores[1], rel_tol=TIE_REL_TOL, abs_tol=1e-12)
