/* The QA task's span search in C: the best spans of one window, when they are strictly ranked.
 *
 * top_cells(start, end, top_k, width) takes one window's start and end probabilities (1-D
 * float32 buffers of the same length n) and returns the top_k spans (s, e, score) with the
 * highest score start[s] * end[e], s <= e < s + width, best first, as a list of tuples; or None
 * when a value is negative, NaN or infinite, fewer than top_k + 1 spans exist, or the best
 * top_k + 1 are not strictly ranked. The caller (tasks/qa_answers.py) then takes its exact
 * numpy search, which orders ties as transformers' pipeline does. When strictly ranked, the top_k are the same spans with the
 * same scores as numpy's: each score is one IEEE float32 product (this file must not be built
 * with -ffast-math), and no sum or other rounding is involved.
 *
 * It keeps the GIL: a window is a few thousand products (a few microseconds), and giving the
 * GIL up would let a worker's tokenizing thread take it for a whole encode.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>

#define MAX_TOP_K 64

typedef struct {
    float score;
    Py_ssize_t start, end;
} Cell;

/* Insert a cell into best[0..*count), kept in descending order, at most `keep` long. */
static void keep_cell(Cell *best, int *count, int keep, float score, Py_ssize_t s,
                      Py_ssize_t e) {
    int at = *count < keep ? (*count)++ : keep - 1;
    while (at > 0 && best[at - 1].score < score) {
        best[at] = best[at - 1];
        at--;
    }
    best[at].score = score;
    best[at].start = s;
    best[at].end = e;
}

/* Whether every value is a finite non-negative float (as probabilities are): only then do the
   products order rows as the pruning below assumes, and only then is numpy's search known to
   pick the same spans (NaN and infinities are left to it). */
static int probabilities(const float *values, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(values[i] >= 0.0f && values[i] <= FLT_MAX)) return 0;
    }
    return 1;
}

/* Scan every span of the window, keeping the best `keep`; returns how many were kept. */
static int scan(const float *start, const float *end, Py_ssize_t n, Py_ssize_t width,
                Cell *best, int keep) {
    float top_end = 0.0f;
    int count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (end[i] > top_end) top_end = end[i];
    }
    for (Py_ssize_t s = 0; s < n; s++) {
        float a = start[s];
        /* a row whose best possible cell cannot enter the kept cells is skipped (products of
           non-negative floats are monotonic, so a * top_end bounds the row) */
        if (count == keep && !(a * top_end > best[keep - 1].score)) continue;
        Py_ssize_t stop = s + width < n ? s + width : n;
        for (Py_ssize_t e = s; e < stop; e++) {
            float score = a * end[e];
            if (count < keep || score > best[keep - 1].score) {
                keep_cell(best, &count, keep, score, s, e);
            }
        }
    }
    return count;
}

static int float_vector(PyObject *object, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->ndim != 1 || view->itemsize != 4 || view->format == NULL ||
        strcmp(view->format, "f") != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D float32 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *spans_list(const Cell *best, int top_k) {
    PyObject *out = PyList_New(top_k);
    if (out == NULL) return NULL;
    for (int i = 0; i < top_k; i++) {
        PyObject *item = Py_BuildValue("(nnd)", best[i].start, best[i].end,
                                       (double)best[i].score);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *top_cells(PyObject *self, PyObject *args) {
    PyObject *start_obj, *end_obj;
    int top_k;
    Py_ssize_t width;
    Py_buffer start, end;
    Cell best[MAX_TOP_K + 1];
    if (!PyArg_ParseTuple(args, "OOin", &start_obj, &end_obj, &top_k, &width)) return NULL;
    if (top_k < 1 || top_k > MAX_TOP_K || width < 1) {
        PyErr_Format(PyExc_ValueError, "top_k must be 1..%d and width at least 1", MAX_TOP_K);
        return NULL;
    }
    if (float_vector(start_obj, &start, "start") < 0) return NULL;
    if (float_vector(end_obj, &end, "end") < 0) {
        PyBuffer_Release(&start);
        return NULL;
    }
    PyObject *result = NULL;
    if (start.shape[0] != end.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "start and end must have the same length");
    } else if (!probabilities((const float *)start.buf, start.shape[0]) ||
               !probabilities((const float *)end.buf, end.shape[0])) {
        result = Py_NewRef(Py_None);  /* not probabilities: numpy decides */
    } else {
        int keep = top_k + 1;
        int count = scan((const float *)start.buf, (const float *)end.buf, start.shape[0],
                         width, best, keep);
        int strict = count == keep;
        for (int i = 0; strict && i + 1 < keep; i++) strict = best[i].score > best[i + 1].score;
        result = strict ? spans_list(best, top_k) : Py_NewRef(Py_None);
    }
    PyBuffer_Release(&start);
    PyBuffer_Release(&end);
    return result;
}

static PyMethodDef methods[] = {
    {"top_cells", top_cells, METH_VARARGS,
     "top_cells(start, end, top_k, width) -> [(start, end, score), ...] best first, or None "
     "when the best top_k + 1 spans are not strictly ranked."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tasks._span_search",
    "The QA task's span search in C (see tasks/qa_answers.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__span_search(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "MAX_TOP_K", MAX_TOP_K) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
