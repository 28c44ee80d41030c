# Metadata lives in pyproject.toml; this file only declares the cffi extension.
from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
