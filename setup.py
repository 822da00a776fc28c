from setuptools import setup

# Everything is in pyproject.toml; this file lets a checkout build the C span search in place:
#   python setup.py build_ext --inplace
setup()
