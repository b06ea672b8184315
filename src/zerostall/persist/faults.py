"""Named points of the writer, the keeper and the restarting trainer where a test injects a fault.

:func:`hit` marks such a point. While ``ZEROSTALL_FAULTS`` is unset (production) it is one
environment lookup and does nothing. Tests set the variable in the environment of the
processes they start; the injector that reads it (hold, raise an errno, exit, wait for a file,
fail ``pwrite``/``fsync``) is not part of the package: it is ``tests/support/zerostall_faultinject.py``,
imported only then.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from zerostall import envvars
from zerostall.errors import MissingDependencyError

__all__ = ["hit", "ENV", "MARK_ENV", "PHASES", "INJECTOR"]

#: the writer's phases, in the order a save passes them (every save job hits each one)
PHASES = ("begin", "write", "checksum", "manifest", "commit", "retention")
ENV = envvars.FAULTS.name
MARK_ENV = envvars.FAULTS_MARK.name
#: the module that carries out what ``ZEROSTALL_FAULTS`` asks for (zerostall's tests ship it)
INJECTOR = "zerostall_faultinject"
_inject: Callable[[str, str], None] | None = None


def hit(phase: str, path: str = "") -> None:
    """A fault point: runs the injector's action for ``phase`` while ``ZEROSTALL_FAULTS`` is set.

    Raises:
        MissingDependencyError: the variable is set but the injector cannot be imported.
    """
    if not os.environ.get(ENV):
        return
    global _inject
    if _inject is None:
        try:
            _inject = importlib.import_module(INJECTOR).hit
        except ImportError as exc:
            raise MissingDependencyError(
                f"{ENV} is set, but its injector {INJECTOR!r} cannot be imported: it ships with zerostall's "
                f"tests (tests/support); put that directory on PYTHONPATH, or unset {ENV}", name=INJECTOR) from exc
    _inject(phase, path)
