"""Collective load: every rank restores its own tree; replicated leaves are read once.

Runs on the training thread of every rank (a load is collective: every rank calls it with the
same checkpoint). Rank ``r`` restores the tree rank ``r`` saved (ranks beyond the saving world
take rank 0's). Leaves that every saving rank referenced (DDP state) are, with
``replicated=BROADCAST``, read by one rank each (spread by bytes) and broadcast; everything
else each rank reads itself. Exchanges after planning, after reading and after copying (bounded
by ``timeout_s``: :mod:`zerostall.distributed.exchange`) make every rank raise the same error
instead of leaving others blocked in a broadcast.
"""

from __future__ import annotations

from typing import Any

from zerostall.distributed.context import active, group_rank_world
from zerostall.distributed.exchange import broadcast, gather
from zerostall.format.manifest import Manifest
from zerostall.messages import WireError, from_wire, to_wire
from zerostall.options import DistributedOptions, LoadOptions, Replicated
from zerostall.restore import (
    ReadRequest,
    assemble,
    load_items,
    new_planner,
    plan_items,
    prepare_reads,
    read_manifest,
)
from zerostall.storage import open_storage

__all__ = ["load", "load_collective", "replicated_leaves", "agree_step", "gather_objects", "raise_together",
           "raise_first", "wire_error"]

_BATCH = 256 << 20


def replicated_leaves(m: Manifest) -> set[int]:
    """Leaves referenced (outside sharded nodes) by every saving rank's tree."""
    common: set[int] | None = None
    for items in m.ranks or (m.items,):
        refs: set[int] = set()
        for node in items.values():
            _collect_refs(node, refs)
        common = refs if common is None else common & refs
    return common or set()


def _collect_refs(node: Any, refs: set[int]) -> None:
    if not isinstance(node, dict) or node.get("type") == "sharded":
        return
    if "leaf" in node:
        refs.add(node["leaf"])
    for v in node.get("values", ()):
        _collect_refs(v, refs)


def _raise_first(statuses: list[Any], rank: int, mine: BaseException | None) -> None:
    for r, st in enumerate(statuses):
        if st is not None:
            if r == rank and mine is not None:
                raise mine
            raise from_wire(WireError.from_json(st))


def _wire(exc: BaseException | None, rank: int, path: str) -> dict[str, Any] | None:
    """``exc`` as JSON for ``all_gather_object`` (plain data: no pickled exception crosses ranks)."""
    if exc is None:
        return None
    w = to_wire(exc, path=path).to_json()
    if w.get("rank") is None:
        w["rank"] = rank
    return w


def _owners(union: list[int], sizes: dict[int, int], world: int) -> dict[int, int]:
    load = [0] * world
    out: dict[int, int] = {}
    for li in sorted(union, key=lambda i: (-sizes[i], i)):
        o = min(range(world), key=lambda r: (load[r], r))
        out[li] = o
        load[o] += sizes[li]
    return out


def load(root_url: str, name: str, items: dict[str, Any] | None, options: LoadOptions | None = None,
         ) -> dict[str, Any]:
    """Load ``root_url/name``: collectively when torch.distributed is active for ``options``, else locally.

    Raises:
        ZerostallError: see :func:`zerostall.load_checkpointables` (collectively: every rank
            raises the same error).
    """
    opts = options or LoadOptions()
    if active(opts.distributed):  # every rank loads its own tree; replicated leaves read once
        return load_collective(root_url, name, items, opts, f"{root_url.rstrip('/')}/{name}")
    return load_items(root_url, name, items, opts)


def load_collective(root_url: str, name: str, items: dict[str, Any] | None, opts: LoadOptions,
                    path: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    group, rank, world = group_rank_world(opts.distributed or DistributedOptions())
    storage = open_storage(root_url)
    err: BaseException | None = None
    thunks: dict[str, Any] = {}
    want: list[int] = []
    planner: Any = None
    m: Any = None
    own: list[Any] = []
    by_leaf: dict[int, list[Any]] = {}
    try:
        m = read_manifest(storage, name, path=path)
        trees = m.ranks or (m.items,)
        tree = trees[rank] if rank < len(trees) else trees[0]
        planner = new_planner(storage, name, m, path)
        thunks = plan_items(planner, tree, items)
        reps = replicated_leaves(m) if opts.replicated is Replicated.BROADCAST and world > 1 else set()
        index = {(lf.file, lf.offset, lf.nbytes): i for i, lf in enumerate(m.leaves)}
        for r in planner.reads:
            li = index.get((r.leaf.file, r.leaf.offset, r.leaf.nbytes))
            if li is not None and li in reps and r.verify and r.device is None:
                by_leaf.setdefault(li, []).append(r)
            else:
                own.append(r)
        want = sorted(by_leaf)
    except BaseException as exc:  # noqa: BLE001 - gathered below, so that every rank raises the same error
        err = exc
    dopts = opts.distributed or DistributedOptions()
    gathered = gather((want, _wire(err, rank, path)), dopts, what="the collective load's plan", path=path)
    _raise_first([g[1] for g in gathered], rank, err)

    # Replicated leaves: one reader each, spread by bytes, grouped into batches per owner.
    union = sorted(set().union(*[set(g[0]) for g in gathered]))
    sizes = {li: m.leaves[li].nbytes for li in union}
    owner = _owners(union, sizes, world)
    batches: list[tuple[int, list[tuple[int, int]], int]] = []  # (owner, [(leaf, offset in batch)], size)
    for o in range(world):
        cur: list[tuple[int, int]] = []
        size = 0
        for li in (li for li in union if owner[li] == o):
            if cur and size + sizes[li] > _BATCH:
                batches.append((o, cur, size))
                cur, size = [], 0
            cur.append((li, size))
            size += sizes[li]
        if cur:
            batches.append((o, cur, size))
    buffers: list[Any] = []
    reads = list(own)
    for o, members, size in batches:
        buf = torch.empty(size, dtype=torch.uint8)
        buffers.append(buf)
        if o == rank:
            arr: Any = buf.numpy()
            mv = memoryview(arr).cast("B")
            reads.extend(ReadRequest(m.leaves[li], mv[off:off + sizes[li]]) for li, off in members)
    err = None
    commit: Any = None
    try:
        commit = prepare_reads(storage, name, m, reads, opts, path)
    except BaseException as exc:  # noqa: BLE001 - gathered below, so that every rank raises the same error
        err = exc
    statuses = gather(_wire(err, rank, path), dopts, what="the collective load's reads", path=path)
    _raise_first(statuses, rank, err)
    # Every rank verified its reads: only now does any rank write into its templates (all or nothing
    # across the group, LoadOptions.atomic); an I/O error while copying is still raised everywhere.
    try:
        commit()
    except BaseException as exc:  # noqa: BLE001 - gathered below
        err = exc
    statuses = gather(_wire(err, rank, path), dopts, what="the collective load's copies", path=path)
    _raise_first(statuses, rank, err)

    on_cuda = dist.get_backend(group) == "nccl"
    for (o, members, _size), buf in zip(batches, buffers, strict=True):
        wire = buf.cuda() if on_cuda else buf
        dist.broadcast(wire, src=dist.get_global_rank(group, o) if group is not None else o, group=group)
        if on_cuda:
            buf.copy_(wire.cpu())
        for li, off in members:
            for r in by_leaf.get(li, ()):
                torch.frombuffer(r.dest, dtype=torch.uint8).copy_(buf[off:off + sizes[li]])
    return assemble(thunks, path)


def agree_step(local_latest: Any, opts: DistributedOptions | None, *, what: str = "agreeing on a step",
               path: str | None = None) -> Any:
    """Rank 0's answer (plain data) to "which step is the latest", on every rank (one broadcast,
    bounded by ``timeout_s``: :mod:`zerostall.distributed.exchange`)."""
    return broadcast(local_latest, opts, what=what, path=path)


def gather_objects(obj: Any, opts: DistributedOptions | None, *, what: str = "a collective exchange",
                   step: int | None = None, path: str | None = None, after: float | None = None) -> list[Any]:
    """Every rank's ``obj`` (plain data), in rank order, on every rank (bounded by ``timeout_s``,
    after the deadline ``after`` of bounded work before it: :mod:`zerostall.distributed.exchange`)."""
    return gather(obj, opts, what=what, step=step, path=path, after=after)


def raise_together(err: BaseException | None, opts: DistributedOptions | None, path: str, *,
                   after: float | None = None) -> None:
    """Raise on every rank the first error any rank had (``err`` is this rank's, or None)."""
    _, rank, _ = group_rank_world(opts)
    _raise_first(gather_objects(_wire(err, rank, path), opts, what="sharing the outcome", path=path, after=after),
                 rank, err)


def raise_first(statuses: list[Any], rank: int, mine: BaseException | None) -> None:
    """Raise the first error of ``statuses`` (each rank's :func:`wire_error`, or None), ``mine``
    for this rank's own (its original object)."""
    _raise_first(statuses, rank, mine)


def wire_error(exc: BaseException | None, rank: int, path: str) -> dict[str, Any] | None:
    """``exc`` as plain data for an exchange (no pickled exception crosses ranks)."""
    return _wire(exc, rank, path)
