"""XOR parity of a memory step across a parity group of keepers, and the rebuild of a lost share.

A :class:`ParityGroup` is ``size >= 2`` keepers (member ``m`` = its host's index in the group),
membership proven with the job's secret (:func:`zerostall.memtier.auth.form`), over a gloo
process group of the members; the layout and arithmetic are :mod:`zerostall.memtier.parity`'s.
A member's *share* of a step is its data files' bytes concatenated in manifest file order.

What holds:

* :meth:`ParityGroup.exchange`: every member calls it for the same step with its own share.
  Each sends every other member its manifest and share size first (a header authenticated with
  an HMAC over the formation, both ends' fresh nonces, the step and the manifest), so that all
  agree on the :class:`~zerostall.memtier.parity.ParityLayout` (every receiver checks the sizes
  its peer computed against its own); then member ``m`` sends member ``s`` only the real bytes of
  its chunk ``j(m, s)`` (never the implicit zeros past its share), in ``chunk_bytes`` pieces with
  :data:`~zerostall.memtier.replica.WINDOW` in flight, and XORs the pieces it receives into its
  stripe's parity (:class:`~zerostall.memtier.parity.Accumulator`). It returns a
  :class:`HeldParity` only once every chunk of its stripe arrived; else it raises.
* :meth:`ParityGroup.rebuild` (every survivor) and :meth:`ParityGroup.receive_rebuilt` (the new
  process, member ``lost`` of a group formed anew with the survivors): survivor ``s`` forms the
  lost member's chunk ``j(lost, s)`` from its parity and the other survivors' chunks of that
  stripe (they send those to ``s``), and sends it to the new member, which so receives about one
  share in all, straight into one buffer per data file, checks every leaf's CRC32C against the
  lost member's manifest (sent by every survivor, which must agree) and returns a
  :class:`~zerostall.memtier.replica.ReceivedStep`. A differing byte is a
  :class:`~zerostall.errors.ReplicaError` naming its leaf, raised by the new member and, through
  its verdict, by every survivor. Two members missing is a ``ReplicaError`` before any byte moves.
* Every wait is bounded by the group's timeout; a dead, silent or refusing peer is a
  ``ReplicaError`` naming the member and the step, and a failed call returns nothing. A link on
  which a transfer failed is not used again (gloo cannot say which of its pieces are in flight;
  the memory they touch stays alive until :meth:`ParityGroup.close`): form a new generation.
* One operation at a time per group: calls from several threads are serialised.
"""

from __future__ import annotations

import functools
import hmac
import json
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import numpy as np

from zerostall.buffers import HostBuffer
from zerostall.errors import InvalidArgumentError, ReplicaError, ZerostallError
from zerostall.format.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from zerostall.jobstore import bounded
from zerostall.lease import host_id
from zerostall.memtier.auth import Formation, form, job_key, mac
from zerostall.memtier.link import OK, GroupEnd, Link, prove
from zerostall.memtier.parity import Accumulator, ParityLayout, xor_into
from zerostall.memtier.replica import CHUNK_BYTES, WINDOW, ReceivedStep, ReplicaOf, _first_bad, _LeafSpans

__all__ = ["HeldParity", "ParityBytes", "ParityGroup"]

_MAX_HEAD = 1 << 20
_REFUSE = 1
#: a final verdict of ``_BAD_LEAF + i``: leaf ``i`` of the rebuilt share differs from its CRC32C
_BAD_LEAF = 100
_LENS, _HEAD, _ACCEPT, _FINAL, _SIZES, _SIZES_OK, _CHUNK0 = 4, 5, 6, 7, 8, 9, 16
_T = TypeVar("_T")


class ParityBytes(Protocol):
    """Memory a parity lies in: a :class:`~zerostall.buffers.HostBuffer` in the keeper that formed
    it, a read-only mapping of its buffer in a trainer that rebuilds from it."""

    @property
    def view(self) -> memoryview: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class HeldParity:
    """What a member holds after :meth:`ParityGroup.exchange` of ``step``: the layout (every
    member's share size), its stripe's parity (``parity.view[:layout.chunk]``, a buffer this
    object owns) and every member's manifest, by member."""

    step: int
    member: int
    layout: ParityLayout
    parity: ParityBytes
    manifests: tuple[bytes, ...]

    def view(self) -> memoryview:
        return self.parity.view[:self.layout.chunk]

    def close(self) -> None:
        self.parity.close()


@dataclass(frozen=True)
class _Head:
    fields: dict[str, Any]
    manifest: bytes
    nonces: tuple[bytes, bytes]


def _views(share: Sequence[memoryview]) -> list[memoryview]:
    out = []
    for v in share:
        mv = memoryview(v)
        out.append(mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B"))
    return out


def _plan(file_sizes: Sequence[int], start: int, end: int, piece: int) -> list[tuple[int, int, int, int]]:
    """Bytes ``[start, end)`` of a share as pieces ``(file, offset in file, length, offset from
    start)``, cut at every ``piece`` bytes from ``start`` and at the files' edges: both ends of a
    transfer compute the same plan from the share's manifest, so each piece is one view of one
    file's buffer at either end (no copy to join two files' bytes)."""
    out = []
    pos = 0
    for fi, n in enumerate(file_sizes):
        a, b = max(start, pos), min(end, pos + n)
        while a < b:
            nxt = min(b, start + ((a - start) // piece + 1) * piece)
            out.append((fi, a - pos, nxt - a, a - start))
            a = nxt
        pos += n
    return out


def _file_sizes(manifest: bytes, whose: str) -> list[int]:
    return [f.size for f in parse_manifest(manifest, path=f"parity:{whose}").files]


def _survivors(size: int, lost: int, alive: Iterable[int]) -> list[int]:
    alive_ = set(alive)
    if not 0 <= lost < size:
        raise InvalidArgumentError(f"lost member {lost} is outside a parity group of {size}", argument="lost")
    if lost in alive_:
        raise InvalidArgumentError(f"member {lost} is both lost and alive", argument="alive")
    gone = sorted(set(range(size)) - alive_ - {lost})
    if gone:
        raise ReplicaError(f"member {lost} of a parity group of {size} cannot be rebuilt: member(s) {gone} are gone "
                           "too, and the group's one parity per stripe survives the loss of one member only")
    return [m for m in range(size) if m != lost]


class ParityGroup(GroupEnd):
    """The ``size`` keepers of job ``job_id``'s parity group ``group``, this one ``member``.

    Arguments as :class:`~zerostall.memtier.replica.ReplicaGroup`'s (a store or its
    ``"host:port"``, the job's secret, never sent); ``generation`` separates formations in one
    store: a group that lost a member forms a new one with the process taking its place. Raises
    :class:`ReplicaError` when the group does not form within ``timeout_s`` or every other member
    refused this one. Members that failed to prove membership are in :attr:`refused`; every
    operation raises at once while one is.
    """

    def __init__(self, store: Any, *, job_id: str, secret: bytes, member: int, size: int,
                 host: str | None = None, group: str = "parity", generation: int = 0,
                 timeout_s: float = 60.0, chunk_bytes: int = CHUNK_BYTES) -> None:
        import torch
        import torch.distributed

        dist: Any = torch.distributed  # its store and group classes are not in its stubs' exports

        if size < 2 or not 0 <= member < size:
            raise InvalidArgumentError(f"member {member} of a parity group of {size}: need size >= 2 and "
                                       "0 <= member < size", argument="member")
        if not 64 << 10 <= chunk_bytes <= 1 << 30:
            raise InvalidArgumentError(f"chunk_bytes {chunk_bytes} is outside [64 KiB, 1 GiB]", argument="chunk_bytes")
        self._torch = torch
        self.job_id, self.member, self.size = job_id, member, size
        self.timeout_s, self.chunk_bytes = float(timeout_s), chunk_bytes
        self._key = job_key(secret, job_id)
        if isinstance(store, str):
            addr, _, port = store.rpartition(":")
            store = bounded(lambda: dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s)),
                            timeout_s, what=f"the store at {store}")
        base = dist.PrefixStore(f"zerostall-parity/{group}/{generation}", store)
        self.formation: Formation = form(base, job_id=job_id, key=self._key, member=member, size=size,
                                         host=host or host_id(), timeout_s=self.timeout_s)
        ranks = sorted(self.formation.members)
        self._pg_ranks = {m: i for i, m in enumerate(ranks)}
        try:
            self._pg: Any = dist.ProcessGroupGloo(dist.PrefixStore(f"pg/{self.formation.group_id}", base),
                                                  ranks.index(member), len(ranks), timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise ReplicaError(f"the transport of parity group {group!r} of job {job_id!r} (members {ranks}) did "
                               f"not connect within {timeout_s:g} s: {exc}") from exc
        self._failed: dict[int, str] = {}
        self._kept: list[Any] = []
        self._lock = threading.Lock()
        self._op = threading.Lock()
        self._threads = ThreadPoolExecutor(2 * size, thread_name_prefix="zerostall-parity")

    def __enter__(self) -> ParityGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- exchange -----------------------------------------------------------------------------

    def exchange(self, step: int, manifest: bytes, share: Sequence[memoryview], *,
                 spare: HostBuffer | None = None) -> HeldParity:
        """Form this member's stripe parity of ``step`` with every other member (each calls this
        for the same step with its own manifest and share: its data files' bytes in manifest
        order). ``spare``: a parity buffer nothing uses any more (an older step's, once a newer
        one is held), which this call takes over: the parity is formed in it when it fits, else it
        is freed. Raises :class:`ReplicaError` naming the member and step on any failure."""
        views = _views(share)
        size = sum(len(v) for v in views)
        self._check_manifest(manifest, f"member {self.member}'s step {step}", size, InvalidArgumentError)
        own = _file_sizes(manifest, f"member {self.member}'s step {step}")
        if [len(v) for v in views] != own:
            raise InvalidArgumentError(f"share has views of {[len(v) for v in views]} bytes; step {step}'s manifest "
                                       f"has files of {own}: one view per data file, in manifest order",
                                       argument="share")
        with self._op:
            self._all_present(f"step {step}'s parity exchange")
            me, peers = self.member, [p for p in range(self.size) if p != self.member]
            outs = {p: self._link(p, True) for p in peers}
            ins = {p: self._link(p, False) for p in peers}
            head = {"op": "exchange", "step": step, "size": size}

            def check(p: int, d: dict[str, Any], man: bytes) -> str | None:
                if d.get("op") != "exchange" or d.get("step") != step:
                    return f"member {p} sent {d.get('op')} of step {d.get('step')}, expected step {step}'s exchange"
                return self._check_manifest(man, f"member {p}'s step {step}", d.get("size"), None)

            jobs: dict[tuple[int, bool], Callable[[], Any]] = {}
            for p in peers:
                jobs[p, True] = functools.partial(self._send_head, outs[p], head, manifest, step)
                jobs[p, False] = functools.partial(self._recv_head, ins[p], check, step)
            got = self._all(jobs, f"step {step}'s parity exchange")
            manifests = [manifest if m == me else got[m, False].manifest for m in range(self.size)]
            sizes = tuple(size if m == me else int(got[m, False].fields["size"]) for m in range(self.size))
            layout = ParityLayout(sizes, self.size)
            parity = spare if spare is not None and layout.chunk <= spare.size <= 2 * max(layout.chunk, 4096) else None
            if parity is None:
                if spare is not None:
                    spare.close()
                parity = HostBuffer(max(layout.chunk, 4096))
            acc = Accumulator(layout, me, parity.view[:layout.chunk])
            mu = threading.Lock()
            sized = json.dumps(list(sizes)).encode()
            jobs = {}
            for p in peers:
                a, b = layout.chunk_range(me, p)
                src = [views[fi][o:o + k] for fi, o, k, _ in _plan(own, a, b, self.chunk_bytes)]
                jobs[p, True] = functools.partial(self._send_chunk, outs[p], got[p, True], sized, src, step)
                jobs[p, False] = functools.partial(
                    self._recv_chunk, ins[p], got[p, False], sized, _file_sizes(manifests[p], f"member {p}'s step {step}"),
                    layout.chunk_range(p, me), step, functools.partial(self._add, mu, acc, p))
            try:
                self._all(jobs, f"step {step}'s parity exchange")
                if not acc.complete:
                    raise ReplicaError(f"step {step}'s parity of stripe {me} lacks the chunks of members {acc.missing}")
            except BaseException:
                parity.close()  # only this thread wrote it: pieces land in slots, not here
                raise
            return HeldParity(step=step, member=me, layout=layout, parity=parity, manifests=tuple(manifests))

    @staticmethod
    def _add(mu: threading.Lock, acc: Accumulator, member: int, off: int, piece: memoryview) -> None:
        with mu:  # an Accumulator takes one piece at a time
            acc.add(member, off, piece)

    # -- rebuild ------------------------------------------------------------------------------

    def rebuild(self, held: HeldParity, lost: int, share: Sequence[memoryview], *, alive: Iterable[int]) -> None:
        """Rebuild member ``lost``'s share of ``held.step`` into the process that took its place
        (member ``lost`` of this group, calling :meth:`receive_rebuilt`), with every other
        survivor in ``alive`` (each calls this with its own ``held`` of the same step and its own
        share of that step). Returns once the new member verified every leaf; raises
        :class:`ReplicaError` (naming the leaf for a byte that differs) otherwise, and at once
        when a member other than ``lost`` is not alive."""
        survivors = _survivors(self.size, lost, alive)
        me, layout, step = self.member, held.layout, held.step
        if me == lost or me != held.member or layout.group != self.size:
            raise InvalidArgumentError(f"member {me} holds the parity of member {held.member} of a group of "
                                       f"{layout.group}: it cannot rebuild member {lost} of this group of {self.size}",
                                       argument="held")
        views = _views(share)
        if sum(len(v) for v in views) != layout.sizes[me]:
            raise InvalidArgumentError(f"share has {sum(len(v) for v in views)} bytes; member {me}'s share of step "
                                       f"{step} has {layout.sizes[me]}", argument="share")
        with self._op:
            self._all_present(f"the rebuild of member {lost}'s step {step}")
            others = [s for s in survivors if s != me]
            lo, hi = layout.chunk_range(lost, me)
            n = hi - lo
            out = HostBuffer(max(n, 4096))
            try:
                self._rebuild(held, lost, views, others, out, n)
            except BaseException:
                with self._lock:  # a posted send may still read it
                    self._kept.append(out)
                raise
            out.close()

    def _rebuild(self, held: HeldParity, lost: int, views: list[memoryview], others: list[int], out: HostBuffer,
                 n: int) -> None:
        me, layout, step = self.member, held.layout, held.step
        what = f"the rebuild of member {lost}'s step {step}"
        np.copyto(np.frombuffer(out.view, dtype=np.uint8, count=n), np.frombuffer(held.view(), np.uint8, count=n))
        sized = json.dumps(list(layout.sizes)).encode()
        part = {"op": "part", "step": step, "lost": lost}
        if others:
            outs = {s: self._link(s, True) for s in others}
            ins = {s: self._link(s, False) for s in others}

            def check(p: int, d: dict[str, Any], man: bytes) -> str | None:
                if (d.get("op"), d.get("step"), d.get("lost")) != ("part", step, lost):
                    return f"member {p} sent {d.get('op')} of step {d.get('step')}, expected {what}"
                return None

            jobs: dict[tuple[int, bool], Callable[[], Any]] = {}
            for s in others:
                jobs[s, True] = functools.partial(self._send_head, outs[s], part, sized, step)
                jobs[s, False] = functools.partial(self._recv_head, ins[s], check, step)
            got = self._all(jobs, what)
            mu = threading.Lock()
            jobs = {}

            def xor(off: int, t: memoryview) -> None:
                with mu:
                    xor_into(out.view[off:off + len(t)], t)

            own = _file_sizes(held.manifests[me], f"member {me}'s step {step}")
            for s in others:
                # survivor s needs my chunk j(me, s) as far as the lost member's chunk j(lost, s) goes
                a, b = layout.chunk_range(me, s)
                need = layout.chunk_range(lost, s)
                src = [views[fi][o:o + k] for fi, o, k, _ in _plan(own, a, min(b, a + need[1] - need[0]),
                                                                    self.chunk_bytes)]
                jobs[s, True] = functools.partial(self._send_chunk, outs[s], got[s, True], sized, src, step)
                ra, rb = layout.chunk_range(s, me)
                jobs[s, False] = functools.partial(
                    self._recv_chunk, ins[s], got[s, False], sized,
                    _file_sizes(held.manifests[s], f"member {s}'s step {step}"), (ra, min(rb, ra + n)), step, xor)
            self._all(jobs, what)
        link = self._link(lost, True)
        man = held.manifests[lost]
        files = [f.size for f in parse_manifest(man, path=f"parity:member{lost}/step{step}").files]
        head = {"op": "rebuilt", "step": step, "lost": lost, "stripe": me, "sizes": list(layout.sizes)}
        lo, hi = layout.chunk_range(lost, me)
        plan = _plan(files, lo, hi, self.chunk_bytes)

        def send() -> int:
            self._send_head(link, head, man, step)
            self._send_pieces(link, [out.view[pos:pos + k] for _, _, k, pos in plan])
            return link.code(None, _FINAL, "the new member's check")

        verdict = self._all({(lost, True): send}, what)[lost, True]
        if verdict != OK:
            leaves = parse_manifest(man, path=f"parity:member{lost}/step{step}").leaves
            i = verdict - _BAD_LEAF
            key = leaves[i].key if 0 <= i < len(leaves) else None
            raise ReplicaError(f"{link.who} found bytes of member {lost}'s rebuilt step {step} that differ from "
                               f"the CRC32C taken at staging (leaf {key!r}): a share or parity of the group is "
                               "wrong; nothing was rebuilt", key=key)

    def receive_rebuilt(self, of: ReplicaOf, *, alive: Iterable[int],
                        reuse: Sequence[HostBuffer] = ()) -> ReceivedStep:
        """As the process taking the place of this member (``self.member`` is the lost one),
        receive its share of step ``of.step`` from the survivors in ``alive`` (each calls
        :meth:`rebuild`). ``reuse``: buffers nothing uses any more, taken over as
        :meth:`~zerostall.memtier.replica.ReplicaGroup.recv_step` does. Returns the step only once
        every leaf matched its CRC32C; else raises :class:`ReplicaError` (naming the leaf) and
        keeps nothing."""
        spare = list(reuse)
        try:
            return self._receive_rebuilt(of, alive, spare)
        finally:
            for b in spare:
                b.close()

    def _receive_rebuilt(self, of: ReplicaOf, alive: Iterable[int], spare: list[HostBuffer]) -> ReceivedStep:
        lost, step = self.member, of.step
        what = f"the rebuild of member {lost}'s step {step}"
        survivors = _survivors(self.size, lost, alive)
        with self._op:
            self._all_present(what)
            ins = {s: self._link(s, False) for s in survivors}

            def check(p: int, d: dict[str, Any], man: bytes) -> str | None:
                if (d.get("op"), d.get("step"), d.get("lost"), d.get("stripe")) != ("rebuilt", step, lost, p):
                    return f"member {p} sent {d.get('op')} of step {d.get('step')}, expected {what}"
                return self._check_manifest(man, f"member {lost}'s step {step}", None, None)

            got: dict[tuple[int, bool], _Head] = {}
            try:
                self._all({(s, False): functools.partial(self._recv_head, ins[s], check, step, answer=False)
                           for s in survivors}, what, got)
            except ReplicaError:
                # the survivors whose header passed wait for a verdict: refuse, so they raise now
                self._all({k: functools.partial(ins[k[0]].code, _REFUSE, _ACCEPT, "the header's verdict")
                           for k in got}, what)
                raise
            heads = [got[s, False] for s in survivors]
            first = heads[0]
            agree = all(h.manifest == first.manifest and h.fields.get("sizes") == first.fields.get("sizes")
                        for h in heads)
            man: Manifest | None = None
            why = None
            try:
                man = parse_manifest(first.manifest, path=f"parity:member{lost}/step{step}")
                layout = ParityLayout(tuple(int(x) for x in first.fields["sizes"]), self.size)
                lengths = [f.size for f in man.files]
                if sum(lengths) != layout.sizes[lost]:
                    why = f"member {lost}'s manifest has {sum(lengths)} bytes, its size is {layout.sizes[lost]}"
            except (ZerostallError, KeyError, TypeError, ValueError) as exc:
                why = f"the survivors' header of {what} is not usable: {exc}"
            if not agree:
                why = f"the survivors disagree on member {lost}'s manifest or the group's sizes of step {step}"
            verdict = OK if why is None else _REFUSE
            self._all({(s, False): functools.partial(ins[s].code, verdict, _ACCEPT, "the header's verdict")
                       for s in survivors}, what)
            if why is not None or man is None:
                raise ReplicaError(f"{what}: {why}", rank=of.rank)
            if len(spare) == len(lengths) and all(n <= b.size <= 2 * max(n, 4096)
                                                  for b, n in zip(spare, lengths, strict=True)):
                buffers, spare[:] = spare[:], []
            else:
                buffers = [HostBuffer(max(n, 4096)) for n in lengths]
            torch = self._torch
            whole = [torch.frombuffer(b.view, dtype=torch.uint8) for b in buffers]

            def recv(s: int) -> None:
                a, b = layout.chunk_range(lost, s)
                plan = _plan(lengths, a, b, int(got[s, False].fields["chunk"]))
                self._recv_pieces(ins[s], [whole[fi][o:o + k] for fi, o, k, _ in plan], None)

            try:
                self._all({(s, False): functools.partial(recv, s) for s in survivors}, what)
            except BaseException:
                with self._lock:  # a piece may still land in them: freed at close()
                    self._kept.extend(buffers)
                raise
            spans = _LeafSpans(man, len(lengths))
            bad = _first_bad(man, [p for fi, n in enumerate(lengths) if n for p in spans(fi, 0, buffers[fi].view[:n])])
            code = OK if bad is None else _BAD_LEAF + next(i for i, lf in enumerate(man.leaves) if lf.key == bad)
            try:
                self._all({(s, False): functools.partial(ins[s].code, code, _FINAL, "the final verdict")
                           for s in survivors}, what)
            except BaseException:
                for b in buffers:
                    b.close()
                raise
            if bad is not None:
                for b in buffers:
                    b.close()
                raise ReplicaError(f"member {lost}'s share of step {step}, rebuilt from the parity group, has bytes "
                                   "that differ from the CRC32C taken at staging: a share or parity of the group is "
                                   "wrong; it is not kept", key=bad, rank=of.rank)
            names = [f.path.rsplit("/", 1)[-1] for f in man.files]
            return ReceivedStep(of, first.manifest, names, lengths, buffers)

    # -- links and messages -------------------------------------------------------------------

    def _all_present(self, what: str) -> None:
        missing = {m: self.formation.refused.get(m, "it did not join") for m in range(self.size)
                   if m not in self.formation.members}
        if missing:
            raise ReplicaError(f"{what} needs every member of the parity group; member(s) {sorted(missing)} are not "
                               f"in it: {missing}")

    def _link(self, peer: int, sending: bool) -> Link:
        with self._lock:
            if peer in self._failed:
                raise ReplicaError(f"the link to member {peer} failed earlier ({self._failed[peer]}); form a new "
                                   "group (a new generation) to use it again")
        me = self.member
        return Link(self._torch, self._pg, self._pg_ranks[peer], peer=peer, src=me if sending else peer,
                    dst=peer if sending else me, host=self.formation.members[peer].host, timeout_s=self.timeout_s,
                    broken=self._broken)

    def _broken(self, link: Link, why: str) -> ReplicaError:
        with self._lock:
            self._failed.setdefault(link.peer, why)
            self._kept.extend(link.live)
        return ReplicaError(why)

    def _all(self, jobs: dict[tuple[int, bool], Callable[[], _T]], what: str,
             out: dict[tuple[int, bool], _T] | None = None) -> dict[tuple[int, bool], _T]:
        """Run every job on its own thread, wait for all (each wait inside is bounded), and raise
        the first failure, by member, naming it and ``what``; the results, by job, go in ``out``
        (those that succeeded, if one failed) and are returned."""
        futs = {k: self._threads.submit(f) for k, f in jobs.items()}
        out = {} if out is None else out
        errs: list[tuple[tuple[int, bool], BaseException]] = []
        for k, f in futs.items():
            err = f.exception()  # every job is waited for before one raises
            if err is None:
                out[k] = f.result()
            else:
                errs.append((k, err))
        if errs:
            (peer, sending), first = min(errs, key=lambda e: e[0])
            if isinstance(first, ReplicaError):
                raise ReplicaError(f"{what} failed {'sending to' if sending else 'receiving from'} member {peer}: "
                                   f"{first}", key=first.key, rank=first.rank) from first
            raise first
        return out

    def _check_manifest(self, manifest: bytes, whose: str, size: object,
                        error: type[ZerostallError] | None) -> str | None:
        """Why ``manifest`` is not a share's of ``size`` bytes (None when ``size`` is None) whose
        every leaf has a CRC32C (raised as ``error`` if given), or None."""
        why = None
        try:
            man = parse_manifest(manifest, path=f"parity:{whose}")
        except ZerostallError as exc:
            why = f"{whose}'s manifest does not parse: {exc}"
        else:
            total = sum(f.size for f in man.files)
            unchecked = [lf.key for lf in man.leaves if lf.crc32c is None and lf.nbytes]
            if size is not None and (type(size) is not int or total != size):
                why = f"{whose}'s share has {size} bytes, its manifest's files {total}"
            elif unchecked:
                why = f"leaf {unchecked[0]!r} of {whose} has no CRC32C: a rebuilt share could not be verified"
        if why is not None and error is not None:
            raise error(why)
        return why

    def _send_head(self, link: Link, fields: dict[str, Any], manifest: bytes, step: int) -> tuple[bytes, bytes]:
        """Prove the link, send an authenticated header and ``manifest``, wait for the verdict."""
        torch = self._torch
        nr, ns = prove(link, self._key, self.formation.group_id)
        head = json.dumps({"v": 1, "job": self.job_id, "group": self.formation.group_id, "from": link.src,
                           "to": link.dst, "chunk": self.chunk_bytes, **fields}, sort_keys=True).encode()
        tag = mac(self._key, b"parity-head", self.formation.group_id.encode(), nr, ns, head, manifest)
        link.wait(link.send(torch.tensor([len(head), len(manifest)], dtype=torch.int64), _LENS), "the header")
        link.wait(link.send(torch.frombuffer(bytearray(head + manifest + tag), dtype=torch.uint8), _HEAD), "the header")
        if link.code(None, _ACCEPT, "the header's verdict") != OK:
            raise ReplicaError(f"{link.who} refused step {step}'s header")
        return nr, ns

    def _recv_head(self, link: Link, check: Callable[[int, dict[str, Any], bytes], str | None], step: int, *,
                   answer: bool = True) -> _Head:
        """Prove the link and receive a header; refuse it (and raise) when its MAC, its ids or
        ``check`` fail. ``answer=False``: the caller sends the verdict once it has every header."""
        torch = self._torch
        nr, ns = prove(link, self._key, self.formation.group_id)
        lens = torch.zeros(2, dtype=torch.int64)
        link.wait(link.recv(lens, _LENS), "the header")
        hl, ml = int(lens[0]), int(lens[1])
        if not (0 < hl <= _MAX_HEAD and 0 < ml <= MAX_MANIFEST_BYTES):
            raise self._broken(link, f"{link.who} announced a header of {hl} and a manifest of {ml} bytes")
        body = torch.empty(hl + ml + 32, dtype=torch.uint8)
        link.wait(link.recv(body, _HEAD), "the header")
        raw = bytes(body.numpy())
        head, manifest, tag = raw[:hl], raw[hl:hl + ml], raw[hl + ml:]
        why: str | None = None
        d: dict[str, Any] = {}
        if not hmac.compare_digest(tag, mac(self._key, b"parity-head", self.formation.group_id.encode(), nr, ns,
                                            head, manifest)):
            why = f"{link.who} sent a header of step {step} that does not authenticate under the job secret"
        else:
            try:
                d = json.loads(head)
                ids = (d["job"], d["group"], d["from"], d["to"])
                piece = int(d["chunk"])
            except (ValueError, KeyError, TypeError):
                why = f"{link.who} sent a header that is not a parity header"
            else:
                if ids != (self.job_id, self.formation.group_id, link.src, link.dst):
                    why = f"{link.who} sent a header for another transfer"
                elif not 64 << 10 <= piece <= 1 << 30:
                    why = f"{link.who} announced pieces of {piece} bytes"
                else:
                    why = check(link.peer, d, manifest)
        if why is not None:
            link.code(_REFUSE, _ACCEPT, "the header's verdict")
            raise ReplicaError(why)
        if answer:
            link.code(OK, _ACCEPT, "the header's verdict")
        return _Head(d, manifest, (nr, ns))

    def _send_chunk(self, link: Link, nonces: tuple[bytes, bytes], sized: bytes, src: list[memoryview],
                    step: int) -> None:
        """Send the sizes this member computed (authenticated), then, once the peer agreed, the
        real bytes of a chunk (``src``, views of the share) in pieces; wait for its verdict."""
        torch = self._torch
        nr, ns = nonces
        tag = mac(self._key, b"parity-sizes", self.formation.group_id.encode(), nr, ns, sized)
        link.wait(link.send(torch.frombuffer(bytearray(sized.ljust(_MAX_SIZES, b" ") + tag), dtype=torch.uint8),
                            _SIZES), "the group's sizes")
        if link.code(None, _SIZES_OK, "the sizes' verdict") != OK:
            raise ReplicaError(f"{link.who} computed other share sizes of step {step}'s group")
        self._send_pieces(link, src)
        if link.code(None, _FINAL, "the receiver's verdict") != OK:
            raise ReplicaError(f"{link.who} refused the chunk of step {step}")

    def _recv_chunk(self, link: Link, head: _Head, sized: bytes, files: list[int], span: tuple[int, int], step: int,
                    into: Callable[[int, memoryview], None]) -> None:
        """The other end of :meth:`_send_chunk`: bytes ``span`` of the sender's share (whose
        files have sizes ``files``), each piece handed to ``into(offset from span's start, bytes)``."""
        torch = self._torch
        nr, ns = head.nonces
        got = torch.empty(_MAX_SIZES + 32, dtype=torch.uint8)
        link.wait(link.recv(got, _SIZES), "the group's sizes")
        raw = bytes(got.numpy())
        ok = hmac.compare_digest(raw[_MAX_SIZES:], mac(self._key, b"parity-sizes", self.formation.group_id.encode(),
                                                       nr, ns, raw[:_MAX_SIZES].rstrip(b" ")))
        same = raw[:_MAX_SIZES].rstrip(b" ") == sized
        link.code(OK if ok and same else _REFUSE, _SIZES_OK, "the sizes' verdict")
        if not (ok and same):
            raise ReplicaError(f"{link.who} {'computed other share sizes' if ok else 'sent sizes that do not authenticate'}"
                           f" for step {step}'s group")
        plan = [(pos, k) for _, _, k, pos in _plan(files, span[0], span[1], int(head.fields["chunk"]))]
        self._recv_pieces(link, None, (plan, into))
        link.code(OK, _FINAL, "the final verdict")

    def _send_pieces(self, link: Link, src: list[memoryview]) -> None:
        """Each of ``src`` (a :func:`_plan`'s pieces, none empty) as one message, :data:`WINDOW`
        in flight; no copy."""
        torch = self._torch
        pending: list[Any] = []
        for i, v in enumerate(src):
            with warnings.catch_warnings():  # a read-only mapping: gloo only reads it
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(v, dtype=torch.uint8)
            pending.append(link.send(t, _CHUNK0 + i))
            if len(pending) >= WINDOW:
                link.wait(pending.pop(0), "sending a piece")
        for w in pending:
            link.wait(w, "sending a piece")

    def _recv_pieces(self, link: Link, dst: list[Any] | None,
                     xor: tuple[list[tuple[int, int]], Callable[[int, memoryview], None]] | None) -> None:
        """Receive pieces straight into ``dst`` (tensors, in order), or, with ``xor = (plan,
        into)``, the pieces ``(offset, length)`` of ``plan`` through :data:`WINDOW` reused slots,
        each handed to ``into(offset, bytes)`` before its slot takes the next piece."""
        torch = self._torch
        if dst is not None:
            posted: list[Any] = []
            for i, t in enumerate(dst):
                posted.append(link.recv(t, _CHUNK0 + i))
                if len(posted) >= WINDOW:
                    link.wait(posted.pop(0), "receiving a piece")
            for w in posted:
                link.wait(w, "receiving a piece")
            return
        assert xor is not None
        plan, into = xor
        biggest = max((k for _, k in plan), default=0)
        slots = [torch.empty(biggest, dtype=torch.uint8) for _ in range(min(WINDOW, len(plan)))]
        queue: list[tuple[Any, int, int, int]] = []
        nxt = 0
        while nxt < len(plan) or queue:
            while nxt < len(plan) and len(queue) < len(slots):
                a, k = plan[nxt]
                slot = nxt % len(slots)
                queue.append((link.recv(slots[slot][:k], _CHUNK0 + nxt), slot, a, k))
                nxt += 1
            w, slot, a, k = queue.pop(0)
            link.wait(w, "receiving a piece")
            into(a, memoryview(slots[slot].numpy()).cast("B")[:k])


#: bytes of the sizes message before its MAC: a JSON list of a few hundred members' sizes
_MAX_SIZES = 8 << 10
