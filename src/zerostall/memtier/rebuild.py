"""A restore's rebuild of a lost rank's memory step from its parity group, in the trainers.

A restarted job's rank on a new host has an empty keeper; with ``MemoryTier(parity=1)`` the
other members of its parity group (:mod:`zerostall.memtier.paritypeers`) still hold their own
share of the step and their stripe's parity of it. In a load round
(:meth:`zerostall.memtier.tier.MemorySide.load_replicated`) each survivor's trainer maps its own
keeper's step and parity read-only and runs
:meth:`~zerostall.memtier.paritygroup.ParityGroup.rebuild` (:func:`serve_rebuild`), while the new
rank's trainer receives its share, verified leaf by leaf against the CRC32Cs taken at staging,
(:func:`receive_rebuild`) and loads it as it loads a replica. The group of the round is formed
anew for it (its name and the round's number), every member proving the job's secret.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from typing import Any

from zerostall.errors import ReplicaError, ZerostallError
from zerostall.format.manifest import parse_manifest
from zerostall.lease import host_id
from zerostall.memtier.client import KeeperSide
from zerostall.memtier.messages import ReplicaSetup
from zerostall.memtier.parity import ParityLayout
from zerostall.memtier.paritygroup import HeldParity, ParityGroup
from zerostall.memtier.paritypeers import group_name
from zerostall.memtier.replica import ReceivedStep, ReplicaOf
from zerostall.storage.release import unmap_later

__all__ = ["PARITY", "serve_rebuild", "receive_rebuild"]

log = logging.getLogger("zerostall")

#: in a load's plan, the source of a rank's share that its parity group rebuilds
PARITY = -1


class _Mapped:
    """A read-only mapping of a keeper's buffer (:class:`~zerostall.memtier.paritygroup.ParityBytes`)."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.view.release()
        unmap_later(self._map)


def _group(store: Any, setup: ReplicaSetup, member: int, size: int, name: str, generation: int) -> ParityGroup:
    return ParityGroup(store, job_id=setup.job, secret=bytes.fromhex(setup.secret), member=member, size=size,
                       host=host_id(), group=f"rebuild/{name}", generation=generation, timeout_s=setup.timeout_s)


def serve_rebuild(keeper: KeeperSide, store: Any, setup: ReplicaSetup, lost_rank: int, step: int, generation: int,
                  deadline: float) -> None:
    """As a survivor of ``lost_rank``'s parity group: rebuild its share of ``step`` into it from
    this rank's keeper's step and parity (the keeper answering by ``deadline``). A failure is
    logged; the lost rank's receive fails too and says so."""
    name, member, size, ranks = group_name(setup)
    maps: list[_Mapped] = []
    try:
        lost = ranks.index(lost_rank)
        own = keeper.query_image(max(0.0, deadline - time.monotonic()))
        par = keeper.query_image(max(0.0, deadline - time.monotonic()), parity=True)
        for got in (own, par):
            if got is not None:
                maps.extend(_Mapped(fd, f.size) for f, fd in zip(got[0].files, got[1], strict=True))
                for fd in got[1]:
                    os.close(fd)
        if own is None or par is None:
            raise ReplicaError(f"this rank's keeper did not answer within {setup.timeout_s:g} s")
        info = par[0].parity
        if own[0].step != step or info is None or info.step != step:
            raise ReplicaError(f"this rank's keeper no longer holds step {step} and its parity")
        if (info.member, info.size) != (member, size):
            raise ReplicaError(f"this rank's keeper holds the parity of member {info.member} of a group of {info.size}, "
                               f"not of member {member} of {size}")
        img = own[0]
        by_name = {f.name: (f, m) for f, m in zip(img.files, maps, strict=False)}
        share = []
        for mf in parse_manifest(img.manifest.encode(), path=f"memory:{img.name}").files:
            f, m = by_name[mf.path.rsplit("/", 1)[-1]]
            share.append(m.view[:f.length])
        held = HeldParity(step=step, member=member, layout=ParityLayout(info.sizes, info.size), parity=maps[-1],
                          manifests=tuple(m.encode() for m in info.manifests))
        with _group(store, setup, member, size, name, generation) as g:
            g.rebuild(held, lost, share, alive=[m for m in range(size) if m != lost])
    except (ZerostallError, RuntimeError, OSError, KeyError, ValueError) as exc:
        log.warning("zerostall: rank %d's share of step %d was not rebuilt from this rank's parity group: %s",
                    lost_rank, step, exc)
    finally:
        for m in maps:
            m.close()


def receive_rebuild(store: Any, setup: ReplicaSetup, instance: str, step: int, generation: int) -> ReceivedStep:
    """As the rank taking a lost member's place: receive this rank's share of ``step`` from the
    other members of its parity group, every leaf verified. Raises
    :class:`~zerostall.errors.ReplicaError` otherwise."""
    name, member, size, _ = group_name(setup)
    with _group(store, setup, member, size, name, generation) as g:
        return g.receive_rebuilt(ReplicaOf(instance, setup.world, setup.rank, step),
                                 alive=[m for m in range(size) if m != member])
