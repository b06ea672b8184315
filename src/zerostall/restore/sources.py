"""Loading as a chain of sources: this host's memory, then the peers', then storage.

A :class:`~zerostall.Checkpointer` loads a step from the first source that delivers it, and
learns from the answer which step it loaded: a source returns :class:`Loaded`, or None when the
step is not its to give, or another step when it had this one but could not deliver it (a memory
step whose every copy of some rank's share is gone): the sources after it are then asked for that
step instead (storage's newest common one). The core defines the seam and its storage source;
the memory tier adds its own sources in front (:meth:`zerostall.memtier.tier.MemorySide.sources`)
without the core knowing what they are, and a new one (parity across hosts) plugs in beside them.

Under torch.distributed every source answers the same on every rank (its own agreement: a source
is collective when the load is), so every rank walks the chain alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from zerostall.errors import CheckpointNotFoundError

__all__ = ["Loaded", "Source", "load_first"]


@dataclass(frozen=True)
class Loaded:
    """A loaded tree and the step it is of (which may be older than the one asked for)."""

    step: int
    tree: dict[str, Any]


class Source(Protocol):
    """One place a step may be loaded from."""

    #: for logs and errors: "this host's memory", "the keepers of other hosts", "storage"
    name: str

    def load(self, step: int, items: dict[str, Any] | None) -> Loaded | int | None:
        """``step``'s tree into ``items`` (:class:`Loaded`); None: this source does not hold
        ``step``; an int: it held ``step`` but could not deliver it, and that (older) step is the
        one to load instead.

        Raises:
            ZerostallError: a failure of the request itself (a template that does not match), or
                of the one source that could deliver (storage's own errors).
        """


def load_first(sources: Sequence[Source], step: int, items: dict[str, Any] | None, *, path: str) -> Loaded:
    """``step`` from the first of ``sources`` that delivers it (see the module's docstring).

    Raises:
        CheckpointNotFoundError: no source delivered (none held the step).
    """
    want = step
    for source in sources:
        got = source.load(want, items)
        if isinstance(got, Loaded):
            return got
        if got is not None:
            want = got
    raise CheckpointNotFoundError(f"no source holds step {want}", path=path)
