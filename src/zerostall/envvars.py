"""Every environment variable zerostall reads, in one table.

No other module names a ``ZEROSTALL_*`` variable (``tests/unit/test_envvars.py`` checks the
package's code and that README.md's "Environment variables" lists each one). Options belong in
the keyword-only option classes; a variable is here only where an option cannot reach: a value
that must be the same in every process of a host (the host id), a process the user does not
start (the writer, the keeper), the command line, or a test harness.

A bottom layer: it imports nothing from zerostall but :mod:`zerostall.errors`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from zerostall.errors import ZerostallWarning

__all__ = [
    "Var", "VARIABLES", "HOST_ID", "LEASE_S", "DEBUG", "PROGRESS_DELAY_S", "S3_PREFIX", "FAULTS", "FAULTS_MARK",
    "DEVICE_LOADS", "CUDA_ENQUEUE_THREAD", "get", "switch", "settled_switches",
]


@dataclass(frozen=True)
class Var:
    """One variable: its name, what it does, and who sets it."""

    name: str
    doc: str
    #: ``user``: a setting for users; ``test``: read only when a test harness sets it; ``ab``: an
    #: on/off switch kept until a measurement on hardware this project has not had decides it
    audience: str = "user"


HOST_ID = Var("ZEROSTALL_HOST_ID",
              "This host's name for leases and the memory tier (default: the hostname qualified by the PID "
              "namespace). Set it where hostnames collide; tests simulate several hosts on one machine with it.")
LEASE_S = Var("ZEROSTALL_LEASE_S",
              "How long a writer's lease on a partial checkpoint lasts without renewal, in seconds (default 60): "
              "after it, another host may clean the partial directory up. With memory-tier replicas, also how "
              "long after a keeper stops renewing its keeper lease a replica holder may stand in for it (keep it "
              "below DistributedOptions.timeout_s).")
DEBUG = Var("ZEROSTALL_DEBUG",
            "Non-empty: the command line prints tracebacks, and the writer and keeper log theirs.")
PROGRESS_DELAY_S = Var("ZEROSTALL_PROGRESS_DELAY_S",
                       "Seconds before the command line draws a progress line (default 1; 0 at once).")
#: ``ZEROSTALL_S3_<FIELD>`` sets each field of :class:`zerostall.storage.s3.S3Options`
S3_PREFIX = "ZEROSTALL_S3_"
_S3 = Var(S3_PREFIX + "<FIELD>",
          "Each field of S3Options (PART_SIZE, CONCURRENCY, MAX_ATTEMPTS, RETRY_MODE, CONNECT_TIMEOUT, READ_TIMEOUT, "
          "ADDRESSING_STYLE); passed on to the writer process with the AWS_* variables.")
FAULTS = Var("ZEROSTALL_FAULTS",
             "Test harness only: a JSON object of fault-injection points; the injector is tests/support/zerostall_faultinject.py, "
             "not part of the package (zerostall.persist.faults).", audience="test")
FAULTS_MARK = Var("ZEROSTALL_FAULTS_MARK",
                  "Test harness only: a directory where the injector marks each point reached.", audience="test")
DEVICE_LOADS = Var("ZEROSTALL_DEVICE_LOADS",
                   "0: load into CUDA templates through a host tensor per leaf instead of the page-locked device "
                   "pass, which has not yet run on a GPU (benchmarks/gpu_restore.py compares the two).", audience="ab")
CUDA_ENQUEUE_THREAD = Var("ZEROSTALL_CUDA_ENQUEUE_THREAD",
                          "0: enqueue an overlapped save's CUDA copies on the training thread instead of zerostall's "
                          "enqueuer thread (benchmarks/gpu.py compares the two on a GPU).", audience="ab")

VARIABLES: tuple[Var, ...] = (HOST_ID, LEASE_S, DEBUG, PROGRESS_DELAY_S, _S3, FAULTS, FAULTS_MARK, DEVICE_LOADS,
                              CUDA_ENQUEUE_THREAD)

_ON = ("1", "true", "yes", "on", "")
_OFF = ("0", "false", "no", "off")
_READ: set[str] = set()  # the switches this process has read (and warned about)


def get(var: Var, default: str | None = None) -> str | None:
    """The variable's value in this process, or ``default``."""
    return os.environ.get(var.name, default)


def switch(var: Var, what: str) -> bool:
    """An on/off variable: on when unset; 0/false/no/off turn it off, and a value that is neither is
    warned about (a typo must not leave an A/B measuring the same code twice unnoticed). ``what``
    names what stays on, for the warning."""
    _READ.add(var.name)
    value = os.environ.get(var.name, "1").strip().lower()
    if value in _OFF:
        return False
    if value not in _ON:
        warnings.warn(f"{var.name}={value!r} is neither on (1, true, yes, on) nor off (0, false, no, off): "
                      f"{what} stay on", ZerostallWarning, stacklevel=3)
    return True


def settled_switches(env: dict[str, str]) -> dict[str, str]:
    """``env`` (a child process's environment) with every switch this process has read and warned
    about as neither on nor off set to ``1``, which is what it means here: the child (the writer)
    reads the same switches, and the user sees the warning once, not once per process.

    Example::

        >>> import warnings; warnings.simplefilter("ignore")
        >>> os.environ["ZEROSTALL_DEVICE_LOADS"] = "of"; _ = switch(DEVICE_LOADS, "device loads")
        >>> settled_switches({"ZEROSTALL_DEVICE_LOADS": "of"})
        {'ZEROSTALL_DEVICE_LOADS': '1'}
        >>> del os.environ["ZEROSTALL_DEVICE_LOADS"]
    """
    out = dict(env)
    for name in _READ:
        value = out.get(name)
        if value is not None and value.strip().lower() not in _ON + _OFF:
            out[name] = "1"
    return out
