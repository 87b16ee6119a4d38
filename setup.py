"""Build hook: only the CFFI extension modules (see native/)."""
from setuptools import setup

setup(cffi_modules=["native/build_seccomp.py:ffibuilder"])
