"""Where a rank's replicas go, and which ranks form its parity group: keepers on other hosts,
never on the original's host.

Ranks are numbered host by host (``ranks_per_host`` consecutive ranks per host, as torchrun
assigns them), so the rank ``k * ranks_per_host`` places further lies on the ``k``-th host
along, as GEMINI and NVIDIA's in-memory checkpointing place theirs. A parity group is the ranks
of one local index on consecutive hosts (:func:`parity_groups`): one rank per host, so a lost
host costs each of its groups one member, which one parity per stripe rebuilds.
"""

from __future__ import annotations

from zerostall.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["DEFAULT_PARITY_GROUP", "parity_groups", "parity_group_of", "replica_holders", "replica_origins"]

#: hosts per parity group when the user sets none (MemoryTier.parity_group's docstring says why)
DEFAULT_PARITY_GROUP = 8


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


def parity_groups(world: int, ranks_per_host: int, group: int | None = None) -> list[list[int]]:
    """The job's parity groups, each a list of ranks (member ``m`` is the ``m``-th): the ranks of
    one local index on ``group`` consecutive hosts (None: :data:`DEFAULT_PARITY_GROUP`, or all the
    hosts when fewer). A remainder of hosts forms a last, smaller group; a remainder of one host
    joins the group before it instead (a group of one protects nothing).

    Example::

        >>> parity_groups(8, 2, 2)
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        >>> parity_groups(5, 1, 2)
        [[0, 1], [2, 3, 4]]
    """
    _check(0, world, ranks_per_host, 0)
    hosts = world // ranks_per_host
    if hosts * ranks_per_host != world or hosts < 2:
        raise InvalidArgumentError(f"parity needs at least 2 hosts holding {ranks_per_host} ranks each; a world of "
                                   f"{world} ranks spans {world / ranks_per_host:g}", argument="parity_group")
    size = min(hosts, DEFAULT_PARITY_GROUP) if group is None else group
    if type(size) is not int or not 2 <= size <= hosts:
        raise InvalidArgumentError(f"parity_group={group!r} needs 2 <= parity_group <= the job's {hosts} hosts",
                                   argument="parity_group")
    blocks = [list(range(h, min(h + size, hosts))) for h in range(0, hosts, size)]
    if len(blocks) > 1 and len(blocks[-1]) == 1:
        last = blocks.pop()
        blocks[-1] += last
    return [[h * ranks_per_host + local for h in block] for block in blocks for local in range(ranks_per_host)]


def parity_group_of(rank: int, groups: list[list[int]]) -> tuple[int, int]:
    """(index of ``rank``'s group in ``groups``, its member number in it)."""
    for i, g in enumerate(groups):
        if rank in g:
            return i, g.index(rank)
    raise InvalidArgumentError(f"rank {rank} is in no parity group", argument="rank")
