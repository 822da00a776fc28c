"""The package is described in pyproject.toml; only its one C extension is declared here, as
setuptools' stable ``ext_modules`` (pyproject's own table for it is still experimental).

The QA task's span search in C (tasks/_span_search.c; tasks/qa_answers.py falls back to numpy
without it). Optional: a machine without a C compiler still builds and installs, and spends
about 30 us more CPU per QA request. In a checkout: ``python setup.py build_ext --inplace``.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tasks._span_search", ["tasks/_span_search.c"], optional=True)])
