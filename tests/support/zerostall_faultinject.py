"""The fault injector of zerostall's tests: ``ZEROSTALL_FAULTS='{"phase": "action"}'`` in the writer's environment.

Not part of the package: :func:`zerostall.persist.faults.hit` imports this module only while
``ZEROSTALL_FAULTS`` is set, and ``tests/conftest.py`` puts ``tests/support`` on ``PYTHONPATH`` so
that the writer, keeper and trainer processes the tests start find it.

Phases (checkpoints in :func:`zerostall.persist.job.run_job`, in order): ``begin``, ``write``,
``checksum``, ``manifest``, ``commit``, ``retention``. Actions:

* ``sleep:<seconds>``: hold the writer there (crash tests kill it meanwhile); if
  ``ZEROSTALL_FAULTS_MARK`` names a directory, the writer first creates ``<phase>-<pid>`` in it,
  so a test knows the writer has reached the phase;
* ``raise:<ERRNO NAME>``: raise ``OSError(errno, ...)`` as a failing system call would;
* ``exit``: the writer process dies at once, as if killed (``os._exit(137)``);
* ``stop``: the process hangs there (it stops itself with SIGSTOP: alive, silent) until a
  SIGCONT; marks arrival in ``ZEROSTALL_FAULTS_MARK`` as ``sleep`` does;
* ``wait:<path>``: block until the file ``path`` exists (lets a test order events without
  timing thresholds); marks arrival in ``ZEROSTALL_FAULTS_MARK`` as ``sleep`` does.

One more phase is not a save's: ``keeper_check``, where the memory tier's keeper starts checking
the held step after its trainer died (:mod:`zerostall.memtier.keeper`). And ``keeper_persist``,
where the keeper starts persisting a memory-only step after its trainer died or closed (the
trainer's own saves never reach it, so ``raise:ENOSPC`` there fails only that persist).
And ``premap_populate``, in the restarted trainer itself (set it in its environment): after its
background thread has mapped the adopted keeper's step and before it pre-faults it
(:mod:`zerostall.memtier.premap`), so a test can load while the pre-fault is still to run.
And ``keeper_serve_replica``, where a keeper is about to hand its trainer the replica of another
rank's step it holds (a restore from memory after a node loss serves it from there).
And ``keeper_bind``, right before the keeper binds its name (``raise:EACCES`` there fails that
bind as an LSM or seccomp policy would: the keeper then serves, unadoptable).

Two more keys fail the real system calls underneath the storage backend, for every call made
while the variable is set (they patch the ``os`` module of the writer process, so use them with
the default process writer; with a thread writer they affect the whole test process):

* ``"pwrite": "raise:<ERRNO NAME>"`` fails data writes (ENOSPC as a full disk reports it);
  ``"pwrite": "short"`` makes every write transfer at most half of what it was asked (the
  writer must loop until done);
* ``"fsync": "raise:<ERRNO NAME>"`` fails every fsync (EIO as a dying disk reports it).

The error carries no file name: the caller's error names the checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from typing import Any

from zerostall.persist.faults import ENV, MARK_ENV

__all__ = ["hit"]
_SYSCALLS = ("pwrite", "fsync")
_patched = False
_patch_lock = threading.Lock()


def _spec() -> dict[str, Any]:
    raw = os.environ.get(ENV)
    if not raw:
        return {}
    spec = json.loads(raw)
    return spec if isinstance(spec, dict) else {}


def _error(arg: str, where: str) -> OSError:
    code = getattr(errno, arg, errno.EIO)
    return OSError(code, f"injected {arg} at {where}")


def hit(phase: str, path: str = "") -> None:
    """Run the action configured for ``phase``, if any. ``path`` is accepted for compatibility."""
    spec = _spec()
    if not spec:
        return
    if any(k in spec for k in _SYSCALLS):
        _patch_syscalls()
    action = spec.get(phase)
    if not action:
        return
    verb, _, arg = str(action).partition(":")
    if verb == "sleep":
        mark = os.environ.get(MARK_ENV)
        if mark:
            with open(os.path.join(mark, f"{phase}-{os.getpid()}"), "w"):
                pass
        time.sleep(float(arg))
    elif verb == "raise":
        raise _error(arg, phase)
    elif verb == "exit":
        os._exit(137)
    elif verb == "stop":  # the process hangs (SIGSTOP: alive, silent) until someone sends SIGCONT
        mark = os.environ.get(MARK_ENV)
        if mark:
            with open(os.path.join(mark, f"{phase}-{os.getpid()}"), "w"):
                pass
        os.kill(os.getpid(), signal.SIGSTOP)
    elif verb == "wait":
        mark = os.environ.get(MARK_ENV)
        if mark:  # as for sleep: the test knows the writer is held here
            with open(os.path.join(mark, f"{phase}-{os.getpid()}"), "w"):
                pass
        deadline = time.monotonic() + 600
        while not os.path.exists(arg) and time.monotonic() < deadline:
            time.sleep(0.01)


def _patch_syscalls() -> None:
    """Wrap ``os.pwrite`` and ``os.fsync`` once; the wrappers consult the variable at each call."""
    global _patched
    with _patch_lock:
        if _patched:
            return
        _patched = True
        real_pwrite, real_fsync = os.pwrite, os.fsync

        def pwrite(fd: int, data: Any, offset: int) -> int:
            action = str(_spec().get("pwrite", ""))
            verb, _, arg = action.partition(":")
            if verb == "raise":
                raise _error(arg, "pwrite")
            if verb == "short":
                view = memoryview(data)
                if len(view) > 1:
                    # Keep direct I/O's block alignment where the request had it.
                    half = len(view) // 2
                    half = half - half % 4096 if half >= 4096 and len(view) % 4096 == 0 else half
                    data = view[:half]
            return real_pwrite(fd, data, offset)

        def fsync(fd: Any) -> None:
            verb, _, arg = str(_spec().get("fsync", "")).partition(":")
            if verb == "raise":
                raise _error(arg, "fsync")
            real_fsync(fd)

        os.pwrite = pwrite
        os.fsync = fsync
