"""The C span search (tasks/_span_search.c) picks exactly what the numpy search picks.

It is an optional build (pyproject.toml): these tests run where it is built, and .ci/run, which
builds it, sets QA_REQUIRE_C_SPAN_SEARCH=1 so that a build that silently failed fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks import qa_answers
from tasks.qa_answers import numpy_top_spans, span_search, top_spans

ROOT = Path(__file__).resolve().parent.parent

try:
    from tasks._span_search import top_cells
except ImportError:  # not built: tasks/qa_answers.py searches in numpy
    top_cells = None

needs_c = pytest.mark.skipif(top_cells is None, reason="the C span search is not built "
                             "(python setup.py build_ext --inplace)")


def probabilities(rng: np.random.Generator, n: int) -> np.ndarray:
    """One window's probabilities, from flat to peaked, sometimes rounded (ties) or with masked
    (zero) tokens, CLS zeroed as ranked_answers does."""
    values = rng.random(n, dtype=np.float32) ** np.float32(rng.uniform(1, 30))
    if rng.random() < 0.3:
        values = np.round(values, int(rng.integers(1, 4))).astype(np.float32)
    if rng.random() < 0.1:
        values[rng.random(n) < 0.5] = 0
    total = values.sum()
    values = (values / total if total > 0 else values).astype(np.float32)
    values[0] = 0
    return values


def every_span_score(start: np.ndarray, end: np.ndarray, width: int) -> list[float]:
    """The score of every span of a window, by brute force."""
    n = start.shape[0]
    return [float(start[s] * end[e]) for s in range(n) for e in range(s, min(n, s + width))]


def test_the_c_search_is_built_where_ci_requires_it() -> None:
    if os.environ.get("QA_REQUIRE_C_SPAN_SEARCH") != "1":
        pytest.skip("only CI requires the build")
    assert top_cells is not None and span_search() == "c"


@needs_c
def test_c_and_numpy_pick_the_same_spans_on_random_windows() -> None:
    rng = np.random.default_rng(11)
    declined = 0
    for _ in range(1500):
        n, width = int(rng.integers(1, 385)), int(rng.integers(1, 31))
        top_k = int(rng.choice([2, 3, 5, 12, 12, 20]))  # 12: what ranked_answers asks for (top_k 1)
        start, end = probabilities(rng, n), probabilities(rng, n)
        expected = numpy_top_spans(start, end, top_k, width)
        found = top_cells(start, end, top_k, min(width, n))
        if found is None:  # declined: ties or too few spans among the best top_k + 1
            declined += 1
            scores = sorted(every_span_score(start, end, width), reverse=True)[:top_k + 1]
            assert len(scores) <= top_k or any(a <= b for a, b in zip(scores, scores[1:]))
        else:
            assert found == expected
        assert top_spans(start, end, top_k, width) == expected
    assert 0 < declined < 750  # both ways were taken


@needs_c
def test_peaked_window_gives_its_best_span_first() -> None:
    start = np.full(50, 0.01, dtype=np.float32)
    end = np.full(50, 0.01, dtype=np.float32)
    start[10], end[13] = 0.5, 0.4
    start += np.linspace(0, 1e-4, 50, dtype=np.float32)  # no ties
    end += np.linspace(1e-4, 0, 50, dtype=np.float32)
    found = top_cells(start, end, 12, 15)
    assert found is not None and len(found) == 12
    assert found[0][:2] == (10, 13)
    assert found[0][2] == float(start[10] * end[13])
    assert all(s <= e < s + 15 for s, e, _ in found)


@needs_c
def test_ties_are_left_to_numpy() -> None:
    flat = np.full(40, 0.025, dtype=np.float32)
    assert top_cells(flat, flat, 12, 15) is None


@needs_c
@pytest.mark.parametrize("bad", [np.nan, np.inf, -0.5])
def test_values_that_are_not_probabilities_are_left_to_numpy(bad: float) -> None:
    """C declines a window holding NaN, an infinity or a negative value (top_spans then takes
    numpy's search, whatever that makes of it)."""
    rng = np.random.default_rng(5)
    start = (rng.random(60, dtype=np.float32) / 30).astype(np.float32)
    end = (rng.random(60, dtype=np.float32) / 30).astype(np.float32)
    assert top_cells(start, end, 12, 15) is not None  # strictly ranked: C answers
    start[30] = np.float32(bad)
    assert top_cells(start, end, 12, 15) is None
    assert top_cells(end, start, 12, 15) is None


@needs_c
@pytest.mark.parametrize("start, end, top_k, width, error", [
    (np.ones(5, dtype=np.float64), np.ones(5, dtype=np.float32), 3, 5, TypeError),
    (np.ones((2, 5), dtype=np.float32), np.ones(5, dtype=np.float32), 3, 5, TypeError),
    (np.ones(5, dtype=np.float32), np.ones(4, dtype=np.float32), 3, 5, ValueError),
    (np.ones(5, dtype=np.float32), np.ones(5, dtype=np.float32), 0, 5, ValueError),
    (np.ones(5, dtype=np.float32), np.ones(5, dtype=np.float32), 65, 5, ValueError),
    (np.ones(5, dtype=np.float32), np.ones(5, dtype=np.float32), 3, 0, ValueError),
    (np.ones(10, dtype=np.float32)[::2], np.ones(5, dtype=np.float32), 3, 5,
     ValueError),  # not contiguous
])
def test_bad_arguments_are_refused(start: np.ndarray, end: np.ndarray, top_k: int, width: int,
                                   error: type[Exception]) -> None:
    with pytest.raises(error):
        top_cells(start, end, top_k, width)


def test_qa_span_search_numpy_turns_the_c_search_off() -> None:
    env = {**os.environ, "QA_SPAN_SEARCH": "numpy"}
    code = "from tasks.qa_answers import span_search; print(span_search())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "numpy"
    assert qa_answers.span_search() == ("numpy" if top_cells is None else "c")
