"""The one thing pyproject.toml cannot say without an experimental table: the C extension.

``zerostall._memcopy`` (streaming-store copies, see ``zerostall.memcopy``) is optional: where no C
compiler is found the install still succeeds and every copy is ``memmove``.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("zerostall._memcopy", ["src/zerostall/_memcopy.c"], optional=True)])
