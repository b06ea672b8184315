"""Where a rank's replicas go: keepers on other hosts, never on the original's host.

Ranks are numbered host by host (``ranks_per_host`` consecutive ranks per host, as torchrun
assigns them), so the rank ``k * ranks_per_host`` places further lies on the ``k``-th host
along, as GEMINI and NVIDIA's in-memory checkpointing place theirs.
"""

from __future__ import annotations

from zerostall.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["replica_holders", "replica_origins"]


def _check(rank: int, world: int, ranks_per_host: int, replicas: int) -> None:
    for name, v in (("rank", rank), ("world", world), ("ranks_per_host", ranks_per_host), ("replicas", replicas)):
        if type(v) is not int:
            raise ArgumentTypeError(f"{name} must be an int, got {type(v).__name__}", argument=name)
    if world < 1 or ranks_per_host < 1 or replicas < 0:
        raise InvalidArgumentError(f"need world >= 1, ranks_per_host >= 1, replicas >= 0; got world={world}, "
                                   f"ranks_per_host={ranks_per_host}, replicas={replicas}", argument="replicas")
    if not 0 <= rank < world:
        raise InvalidArgumentError(f"rank {rank} is outside the world of {world}", argument="rank")


def replica_holders(rank: int, world: int, ranks_per_host: int, replicas: int) -> list[int]:
    """The ranks whose keepers hold ``rank``'s replicas: ``rank + k * ranks_per_host`` (mod
    ``world``) for ``k = 1, 2, ...``, skipping any on ``rank``'s host or on a host already
    chosen, so each replica is on its own host. Raises :class:`InvalidArgumentError` when there
    are fewer other hosts than ``replicas`` (one host: no replica can leave it).

    Example::

        >>> replica_holders(0, 8, 4, 1)
        [4]
        >>> replica_holders(5, 12, 4, 2)
        [9, 1]
    """
    _check(rank, world, ranks_per_host, replicas)
    if replicas == 0:
        return []
    hosts = -(-world // ranks_per_host)
    if hosts - 1 < replicas:
        raise InvalidArgumentError(
            f"{replicas} replica(s) of each rank need {replicas + 1} hosts, but a world of {world} ranks at "
            f"{ranks_per_host} per host spans {hosts}: a replica on its original's host is lost with it",
            argument="replicas")
    own = rank // ranks_per_host
    taken = {own}
    out: list[int] = []
    for k in range(1, world + 1):
        r = (rank + k * ranks_per_host) % world
        if r // ranks_per_host in taken:
            continue
        taken.add(r // ranks_per_host)
        out.append(r)
        if len(out) == replicas:
            return out
    # Every host holds a rank of the same local index or, on a short last host, a lower one that
    # the walk reaches by wrapping; reaching here means the arithmetic above is wrong.
    raise AssertionError(f"placement found {len(out)} of {replicas} holders for rank {rank}")


def replica_origins(holder: int, world: int, ranks_per_host: int, replicas: int) -> list[int]:
    """The ranks whose replicas ``holder``'s keeper holds (the inverse of :func:`replica_holders`)."""
    _check(holder, world, ranks_per_host, replicas)
    return [r for r in range(world) if holder in replica_holders(r, world, ranks_per_host, replicas)]
