"""zerostall's own small collectives (who holds which step, every rank's error, rank 0's answer),
each bounded by ``DistributedOptions.timeout_s``.

torch's ``all_gather_object`` and ``broadcast_object_list`` wait as long as the process group's
timeout (30 minutes for gloo by default), and say nothing of who is missing. Here every
exchange is two collectives of the group (the lengths, then the bytes) whose waits end at
``timeout_s``; one that does not complete raises :class:`~zerostall.errors.PeerUnreachableError`
naming the operation, the step and the ranks that did not answer: after a timeout each rank
that is still alive says so under a key of the job's store and waits a moment for the others',
so the ranks missing there are the ones cut off, hung or not at this collective (a rank that
cannot reach the store says that it is itself cut off). Nothing is written to the store while
every rank answers.

Values travel as JSON (tuples and dicts with non-string keys tagged), never as pickle: a rank
decodes only data from another. Runs on the training thread of every rank of the group; every
rank calls the same exchanges in the same order.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import timedelta
from typing import Any, NoReturn

from zerostall.errors import PeerUnreachableError
from zerostall.jobstore import bounded
from zerostall.options import DistributedOptions

__all__ = ["gather", "broadcast", "encode", "decode"]

#: how long a rank whose exchange timed out waits for the others to say they are alive
_ROLL_CALL_S = 2.0


def gather(obj: Any, opts: DistributedOptions | None, *, what: str, step: int | None = None,
           path: str | None = None, after: float | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank; ``what`` names the operation in an error.

    ``after``: the deadline (``time.monotonic()``) of bounded work every rank does right before
    this exchange (a round of a load from memory): a rank that finished early waits for the others
    until then and ``timeout_s`` more, since a live rank may arrive as late as that deadline.
    """
    import torch
    from torch._C import _distributed_c10d as c10d

    o = opts or DistributedOptions()
    pg, rank, world, seq = _side(o, what, step, path)
    aopts: Any = c10d.AllgatherOptions()
    aopts.timeout = timedelta(seconds=_wait_s(o, after))
    data = encode(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _done(pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)], aopts), o, what, step, path, seq,
          rank)
    lengths = [int(t.item()) for t in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(world)]
    _done(pg.allgather([outs], [mine], aopts), o, what, step, path, seq, rank)
    return [decode(bytes(t[:n].numpy())) for t, n in zip(outs, lengths, strict=True)]


def broadcast(obj: Any, opts: DistributedOptions | None, *, what: str, step: int | None = None,
              path: str | None = None, after: float | None = None) -> Any:
    """Rank 0's ``obj`` (of the group), on every rank (``obj`` of the others is ignored);
    ``after`` as for :func:`gather`."""
    import torch
    import torch.distributed as dist

    o = opts or DistributedOptions()
    pg, rank, _, seq = _side(o, what, step, path)
    data = encode(obj) if rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    bopts: Any = dist.BroadcastOptions()
    bopts.rootRank = 0
    bopts.timeout = timedelta(seconds=_wait_s(o, after))
    _done(pg.broadcast([size], bopts), o, what, step, path, seq, rank)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if rank == 0 and data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    _done(pg.broadcast([buf], bopts), o, what, step, path, seq, rank)
    return decode(bytes(buf.numpy()))


def _wait_s(opts: DistributedOptions, after: float | None) -> float:
    """How long one collective of an exchange waits: ``timeout_s``, plus what is left of ``after``."""
    return opts.timeout_s + (max(0.0, after - time.monotonic()) if after is not None else 0.0)


# -- the values: JSON, tuples and non-string keys tagged --------------------------------------


def encode(obj: Any) -> bytes:
    """``obj`` (None, bool, int, float, str, and lists, tuples and dicts of them) as JSON bytes."""
    return json.dumps(_tag(obj), separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes) -> Any:
    """What :func:`encode` made (tuples and dicts as they were)."""
    return _untag(json.loads(data))


def _tag(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_tag(v) for v in x]
    if isinstance(x, tuple):
        return {"t": [_tag(v) for v in x]}
    if isinstance(x, dict):
        return {"d": [[_tag(k), _tag(v)] for k, v in x.items()]}
    raise TypeError(f"a collective exchange takes plain data, not {type(x).__name__}")


def _untag(x: Any) -> Any:
    if isinstance(x, list):
        return [_untag(v) for v in x]
    if isinstance(x, dict):  # only tags make JSON objects here
        if "t" in x:
            return tuple(_untag(v) for v in x["t"])
        return {_untag(k): _untag(v) for k, v in x["d"]}
    return x


# -- bounded waits ------------------------------------------------------------------------------
#
# The exchanges run on a gloo group of their own, made from the job's store (each request on it
# bounded) the first time the group's ranks exchange, with ``timeout_s`` as its timeout: gloo then
# ends a collective that does not complete at that bound in its own worker too. (A bounded wait
# on a collective of the user's group would leave that group's worker inside the collective until
# the group's own timeout, and the process hanging at exit meanwhile; and it works whatever the
# user's backend is, NCCL included.)


def _group_key(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))


#: (the group's global ranks, timeout_s) -> [the gloo group of the exchanges, how many ran on it, its generation]
_sides: dict[tuple[tuple[int, ...], float], list[Any]] = {}
_generations: dict[tuple[tuple[int, ...], float], int] = {}


def _side(opts: DistributedOptions, what: str, step: int | None, path: str | None) -> tuple[Any, int, int, int]:
    """The exchanges' gloo group of ``opts``' group: (group, this rank in it, its size, this exchange's number)."""
    import torch.distributed as dist

    d: Any = dist  # its store and group classes are not in its stubs' exports
    group = opts.process_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    key = (_group_key(group), float(opts.timeout_s))
    side = _sides.get(key)
    if side is None:
        gen = _generations.get(key, 0)
        default: Any = d.distributed_c10d._get_default_store()
        store = bounded(default.clone, opts.timeout_s,
                        prefix=f"zerostall/exchange/{'-'.join(map(str, key[0]))}/{opts.timeout_s:g}/{gen}")
        try:
            pg = d.ProcessGroupGloo(store, rank, world, timedelta(seconds=opts.timeout_s))
        except Exception as exc:  # noqa: BLE001 - a rank did not come, or the store did not answer
            _generations[key] = gen + 1
            _fail(exc, opts, what, step, path, -gen - 1, rank)
        side = _sides[key] = [pg, 0, gen]
    side[1] += 1  # the ranks run the same exchanges in the same order: the same number names one
    return side[0], rank, world, int(side[2]) * 1_000_000 + int(side[1])


def _done(work: Any, opts: DistributedOptions, what: str, step: int | None, path: str | None, seq: int,
          rank: int) -> None:
    """Wait for ``work`` (bounded by the side group's timeout, ``timeout_s``); on a failure, name
    the ranks that did not answer."""
    try:
        work.wait()
    except RuntimeError as exc:  # the timeout, or a peer's connection closed: the group is spent
        key = (_group_key(opts.process_group), float(opts.timeout_s))
        _sides.pop(key, None)
        _generations[key] = _generations.get(key, 0) + 1
        _fail(exc, opts, what, step, path, seq, rank)


def _fail(cause: BaseException, opts: DistributedOptions, what: str, step: int | None, path: str | None, seq: int,
          rank: int) -> NoReturn:
    missing, cut_off = _roll_call(opts, seq, rank)
    on = f" of step {step}" if step is not None else ""
    if cut_off:
        who = ("no other rank answered, and the job's store did not either: this rank's host is cut off from "
               "the others")
    elif missing:
        who = f"rank(s) {missing} did not answer (cut off, hung, gone, or not at this collective)"
    else:
        who = f"the collective failed ({cause})"
    raise PeerUnreachableError(f"{what}{on}: {who} within {opts.timeout_s:g} s (DistributedOptions.timeout_s)",
                               path=path, rank=rank, step=step, ranks=tuple(missing)) from cause


def _roll_call(opts: DistributedOptions, seq: int, rank: int) -> tuple[list[int], bool]:
    """After a timed-out exchange: (the group's ranks that did not say they are alive, whether the
    job's store itself did not answer this rank)."""
    import torch.distributed as dist

    group = opts.process_group
    ranks = list(_group_key(group))
    try:
        default: Any = dist.distributed_c10d._get_default_store()
        store = bounded(default.clone, _ROLL_CALL_S + 1.0)
    except Exception:  # noqa: BLE001 - no store to ask: no rank can be named
        return [], True
    prefix = f"zerostall/rollcall/{'-'.join(map(str, ranks))}/{seq}"
    me = ranks[rank]
    try:
        store.set(f"{prefix}/{me}", "alive")
    except Exception:  # noqa: BLE001 - the store did not answer this rank: it is the one cut off
        return [], True
    keys = [f"{prefix}/{r}" for r in ranks]
    with contextlib.suppress(Exception):  # the others that are alive answer within the roll call
        store.wait(keys, timedelta(seconds=_ROLL_CALL_S))
    try:
        return [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])], False
    except Exception:  # noqa: BLE001 - the store went away meanwhile
        return [], True
