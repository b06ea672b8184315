"""Replicas of a memory-tier step in another keeper's memory: an authenticated gloo group.

The keepers of one job form a :class:`ReplicaGroup` (membership proven with the job's secret,
:mod:`zerostall.memtier.auth`), and a ``torch.distributed`` gloo process group of the members
that proved it carries the bytes. :meth:`ReplicaGroup.send_step` sends a staged step straight
from its buffers (``torch.frombuffer`` over the mapping: no copy) in ``chunk_bytes`` pieces, a
few in flight; :meth:`ReplicaGroup.recv_step` receives them straight into shared-memory buffers
(memfds, as staging's: the caller's spare ones when they fit, since faulting in and zeroing
fresh memory costs more CPU than receiving into it) and checks every leaf's CRC32C against the
manifest while the next pieces arrive. One transfer, in order:

1. both ends send a fresh nonce, then an HMAC proof over the group, both member ids and both
   nonces, then a verdict on the other's proof: the gloo connection itself is proven to reach a
   holder of the secret before any step byte goes over it (the store that named its address is
   not trusted);
2. the sender sends a header (job, group, members, run id, world size, rank, step, chunk size,
   files) and the manifest, with an HMAC over both and the nonces; the receiver checks the MAC,
   the fields against what it expects, and the manifest (a CRC32C for every leaf), then
   answers accept or refuse;
3. the pieces; then the receiver's verdict on the checksums, which the sender raises on too.

Every wait is bounded by the group's timeout: a dead or silent peer is a :class:`ReplicaError`.
A step that failed is never returned. A link that failed mid-transfer is not used again (gloo
cannot say which of its pieces are still in flight); the buffers such a transfer touched stay
mapped until :meth:`ReplicaGroup.close`.
"""

from __future__ import annotations

import bisect
import hmac
import json
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from zerostall.buffers import HostBuffer
from zerostall.checksum import Span, checksum, join_crcs
from zerostall.errors import ReplicaError, ZerostallError
from zerostall.format.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from zerostall.jobstore import bounded
from zerostall.lease import host_id
from zerostall.memtier.auth import Formation, form, job_key, log, mac
from zerostall.memtier.link import OK as _OK
from zerostall.memtier.link import GroupEnd, Link, prove

__all__ = ["CHUNK_BYTES", "ReplicaOf", "OutgoingStep", "ReceivedStep", "ReplicaGroup", "Scatter"]

#: bytes per piece on the wire (GEMINI's figure): what is in flight stays bounded
CHUNK_BYTES = 16 << 20
#: pieces in flight per transfer
WINDOW = 4
_MAX_HEAD = 1 << 20
_BAD_HEADER, _UNEXPECTED, _CHECKSUM = 2, 3, 4
_VERDICTS = {_BAD_HEADER: "found the header's authentication wrong", _UNEXPECTED: "did not expect this step",
             _CHECKSUM: "found bytes that differ from their CRC32C"}
_LENS, _HEAD, _ACCEPT, _FINAL, _CHUNK0 = 4, 5, 6, 7, 16


@dataclass(frozen=True)
class ReplicaOf:
    """Whose step a replica is: the run, its world size, the rank that staged it, the step."""

    run_id: str
    world: int
    rank: int
    step: int


@dataclass(frozen=True)
class OutgoingStep:
    """A staged step to send: its manifest and each data file's bytes, in the manifest's order
    (``name`` is the last component of the manifest's file path)."""

    of: ReplicaOf
    manifest: bytes
    files: tuple[tuple[str, memoryview], ...]


@dataclass(frozen=True)
class Scatter:
    """Where a received step's bytes go instead of buffers of its own (a load's destinations):
    ``regions[i]`` lists, for data file ``i``, disjoint ``(start, end, memory)`` byte ranges sorted
    by start, ``memory`` holding ``end - start`` writable bytes. A piece inside one range is
    received straight into it; any other piece goes through a small reused buffer, and its bytes
    outside every range are checked, then dropped."""

    regions: list[list[tuple[int, int, memoryview]]]


class ReceivedStep:
    """A replica that arrived and matched every leaf's CRC32C: the manifest and one memfd-backed
    buffer per data file (``buffers[i]`` holds ``lengths[i]`` bytes), which it owns. ``close()``
    frees them; :meth:`release` hands them over to receive a later step into. ``shared`` is
    set once their descriptors went to another process: such buffers are never received into
    again (that process may still read them)."""

    def __init__(self, of: ReplicaOf, manifest: bytes, names: list[str], lengths: list[int],
                 buffers: list[HostBuffer]) -> None:
        self.of, self.manifest, self.names, self.lengths = of, manifest, names, lengths
        self.buffers = buffers
        self.shared = False
        #: received into a :class:`Scatter`'s memory (``buffers`` is then empty), and how many
        #: of its bytes arrived straight there (the rest through a reused buffer)
        self.scattered = False
        self.in_place_bytes = 0

    def view(self, i: int) -> memoryview:
        return self.buffers[i].view[:self.lengths[i]]

    def release(self) -> list[HostBuffer]:
        """The buffers, to pass as ``reuse`` to a later :meth:`ReplicaGroup.recv_step`; this step
        no longer holds them (nor its bytes)."""
        out, self.buffers = self.buffers, []
        return out

    def close(self) -> None:
        for b in self.release():
            b.close()


@dataclass(frozen=True)
class _Refusal:
    code: int
    why: str


class ReplicaGroup(GroupEnd):
    """The keepers of job ``job_id``: ``size`` of them, this one ``member`` (0 .. size-1).

    ``store`` is a ``torch.distributed`` store (the job's ``TCPStore`` under torchrun, or one
    the caller started) or its ``"host:port"``. ``secret`` is the job's secret, the same bytes
    in every keeper and never sent. ``host`` defaults to :func:`zerostall.lease.host_id`
    (``ZEROSTALL_HOST_ID``). ``generation`` separates formations in one store (a restart forms
    a new one). Raises :class:`ReplicaError` when the group does not form within ``timeout_s``
    or this keeper is refused by all. Members that failed to prove membership are in
    :attr:`refused` (and were logged); nothing is ever sent to them or taken from them.
    """

    def __init__(self, store: Any, *, job_id: str, secret: bytes, member: int, size: int,
                 host: str | None = None, group: str = "keepers", generation: int = 0,
                 timeout_s: float = 60.0, chunk_bytes: int = CHUNK_BYTES) -> None:
        import torch
        import torch.distributed

        dist: Any = torch.distributed  # its store and group classes are not in its stubs' exports

        if not 0 <= member < size:
            raise ReplicaError(f"member {member} is outside a group of {size}")
        if not 1 << 20 <= chunk_bytes <= 1 << 30:
            raise ReplicaError(f"chunk_bytes {chunk_bytes} is outside [1 MiB, 1 GiB]")
        self._torch = torch
        self.job_id, self.timeout_s, self.chunk_bytes = job_id, float(timeout_s), chunk_bytes
        self._key = job_key(secret, job_id)
        if isinstance(store, str):
            addr, _, port = store.rpartition(":")
            store = bounded(lambda: dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s)),
                            timeout_s, what=f"the store at {store}")
        base = dist.PrefixStore(f"zerostall-replica/{group}/{generation}", store)
        self.formation: Formation = form(base, job_id=job_id, key=self._key, member=member, size=size,
                                         host=host or host_id(), timeout_s=self.timeout_s)
        ranks = sorted(self.formation.members)
        self._pg_ranks = {m: i for i, m in enumerate(ranks)}
        try:
            self._pg: Any = dist.ProcessGroupGloo(dist.PrefixStore(f"pg/{self.formation.group_id}", base),
                                                  ranks.index(member), len(ranks), timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise ReplicaError(f"the transport of keeper group {job_id!r} (members {ranks}) did not connect "
                               f"within {timeout_s:g} s: {exc}") from exc
        self._failed: dict[int, str] = {}
        self._busy: set[tuple[int, bool]] = set()
        self._lock = threading.Lock()
        self._kept: list[Any] = []
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="zerostall-replica-crc")

    def __enter__(self) -> ReplicaGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- links ------------------------------------------------------------------------------

    def _open(self, peer: int, sending: bool) -> Link:
        if peer not in self.formation.members or peer == self.formation.me.member:
            why = self.formation.refused.get(peer, "it is not another member of this group")
            raise ReplicaError(f"no transfer with member {peer} of keeper group {self.job_id!r}: {why}")
        with self._lock:
            if peer in self._failed:
                raise ReplicaError(f"the link to member {peer} failed earlier ({self._failed[peer]}); "
                                   "form a new group (a new generation) to use it again")
            if (peer, sending) in self._busy:
                raise ReplicaError(f"a transfer {'to' if sending else 'from'} member {peer} is already running")
            self._busy.add((peer, sending))
        me = self.formation.me.member
        return Link(self._torch, self._pg, self._pg_ranks[peer], peer=peer, src=me if sending else peer,
                    dst=peer if sending else me, host=self.formation.members[peer].host, timeout_s=self.timeout_s,
                    broken=self._broken)

    def _close_link(self, link: Link) -> None:
        with self._lock:
            self._busy.discard((link.peer, link.sending))

    def _broken(self, link: Link, why: str) -> ReplicaError:
        with self._lock:
            self._failed.setdefault(link.peer, why)
            self._kept.extend(link.live)
        return ReplicaError(why)

    def _handshake(self, link: Link) -> tuple[bytes, bytes]:
        nr, ns = prove(link, self._key, self.formation.group_id)
        return nr, ns

    # -- sending ----------------------------------------------------------------------------

    def send_step(self, to: int, step: OutgoingStep, *, progress: Callable[[int], None] | None = None) -> None:
        """Send ``step`` to member ``to`` (which calls :meth:`recv_step` for this member); returns
        once the receiver verified every leaf. ``progress(bytes sent so far)`` runs after each
        piece. Raises :class:`ReplicaError` when the peer refuses, dies or times out."""
        link = self._open(to, True)
        try:
            self._send(link, step, progress)
        finally:
            self._close_link(link)

    def _send(self, link: Link, step: OutgoingStep, progress: Callable[[int], None] | None) -> None:
        torch = self._torch
        nr, ns = self._handshake(link)
        of = step.of
        head = json.dumps({"v": 1, "job": self.job_id, "group": self.formation.group_id, "from": link.src,
                           "to": link.dst, "run": of.run_id, "world": of.world, "rank": of.rank, "step": of.step,
                           "chunk": self.chunk_bytes, "files": [[n, len(v)] for n, v in step.files]},
                          sort_keys=True).encode()
        tag = mac(self._key, b"head", self.formation.group_id.encode(), nr, ns, head, step.manifest)
        lens = torch.tensor([len(head), len(step.manifest)], dtype=torch.int64)
        link.wait(link.send(lens, _LENS), "the header")
        body = torch.frombuffer(bytearray(head + step.manifest + tag), dtype=torch.uint8)
        link.wait(link.send(body, _HEAD), "the header")
        answer = link.code(None, _ACCEPT, "the header's verdict")
        if answer != _OK:  # nothing is in flight: the link stays usable
            raise ReplicaError(f"{link.who} {_VERDICTS.get(answer, 'refused the step')} (rank {of.rank}, "
                               f"step {of.step})", rank=of.rank)
        pending: list[tuple[Any, int]] = []
        sent = 0
        for i, (t, n) in enumerate(self._pieces([v for _, v in step.files])):
            pending.append((link.send(t, _CHUNK0 + i), n))
            if len(pending) >= WINDOW:
                w, n0 = pending.pop(0)
                link.wait(w, "sending a piece")
                sent += n0
                if progress is not None:
                    progress(sent)
        for w, n0 in pending:
            link.wait(w, "sending a piece")
            sent += n0
            if progress is not None:
                progress(sent)
        final = link.code(None, _FINAL, "the receiver's check")
        if final != _OK:
            raise ReplicaError(f"{link.who} {_VERDICTS.get(final, 'refused the step')}: rank {of.rank}'s "
                               f"step {of.step} is not replicated there", rank=of.rank)

    def _pieces(self, views: Sequence[memoryview]) -> list[tuple[Any, int]]:
        """``(uint8 tensor over the bytes, length)`` per piece, in order: no copy."""
        torch = self._torch
        out = []
        for v in views:
            if not len(v):
                continue
            with warnings.catch_warnings():  # a read-only mapping: gloo only reads it
                warnings.simplefilter("ignore", UserWarning)
                whole = torch.frombuffer(v, dtype=torch.uint8)
            for a in range(0, len(v), self.chunk_bytes):
                n = min(self.chunk_bytes, len(v) - a)
                out.append((whole[a:a + n], n))
        return out

    # -- receiving --------------------------------------------------------------------------

    def recv_step(self, src: int, *, run_id: str, world: int, rank: int, step: int | None = None,
                  reuse: Sequence[HostBuffer] = (),
                  into: Callable[[Manifest], Scatter | None] | None = None) -> ReceivedStep:
        """Receive the step member ``src`` sends, which must be rank ``rank``'s of run ``run_id``
        at world size ``world`` (and step ``step``, if given). ``reuse``: buffers nothing else
        uses any more (:meth:`ReceivedStep.release`), which this call takes over: the step is
        received into them when they fit its data files (one each, large enough, at most twice
        as large), else they are freed and new ones allocated. ``into``: given the step's
        manifest (authenticated and checked), where to put its bytes instead (None: buffers, as
        without it); a failed transfer may then have written part of that memory. Returns the
        step only once every leaf matched its CRC32C; else raises :class:`ReplicaError` and keeps
        nothing."""
        spare = list(reuse)
        try:
            link = self._open(src, False)
            try:
                return self._recv(link, ReplicaOf(run_id, world, rank, -1 if step is None else step), step is None,
                                  spare, into)
            finally:
                self._close_link(link)
        finally:
            for b in spare:  # the ones the step was not received into
                b.close()

    @staticmethod
    def _fits(spare: Sequence[HostBuffer], lengths: Sequence[int]) -> bool:
        return len(spare) == len(lengths) and all(
            n <= b.size <= 2 * max(n, 4096) for b, n in zip(spare, lengths, strict=True))

    def _recv(self, link: Link, want: ReplicaOf, any_step: bool, spare: list[HostBuffer],
              into: Callable[[Manifest], Scatter | None] | None) -> ReceivedStep:
        torch = self._torch
        nr, ns = self._handshake(link)
        lens = torch.zeros(2, dtype=torch.int64)
        link.wait(link.recv(lens, _LENS), "the header")
        hl, ml = int(lens[0]), int(lens[1])
        if not (0 < hl <= _MAX_HEAD and 0 < ml <= MAX_MANIFEST_BYTES):
            link.code(_BAD_HEADER, _ACCEPT, "the header's verdict")
            raise self._broken(link, f"{link.who} announced a header of {hl} and a manifest of {ml} bytes")
        body = torch.empty(hl + ml + 32, dtype=torch.uint8)
        link.wait(link.recv(body, _HEAD), "the header")
        raw = bytes(body.numpy())
        head, manifest, tag = raw[:hl], raw[hl:hl + ml], raw[hl + ml:]
        checked = self._check_header(link, nr, ns, head, manifest, tag, want, any_step)
        if isinstance(checked, _Refusal):
            link.code(checked.code, _ACCEPT, "the header's verdict")
            raise ReplicaError(checked.why, rank=want.rank)
        of, man, names, lengths, chunk = checked
        try:
            scatter = into(man) if into is not None else None
        except BaseException:
            link.code(_UNEXPECTED, _ACCEPT, "the header's verdict")
            raise
        if scatter is not None:
            link.code(_OK, _ACCEPT, "the header's verdict")
            bad, in_place = self._recv_scattered(link, man, scatter, lengths, chunk)
            link.code(_CHECKSUM if bad is not None else _OK, _FINAL, "the final verdict")
            if bad is not None:
                raise ReplicaError(f"the replica of rank {of.rank}'s step {of.step} from {link.who} has bytes that "
                                   "differ from the CRC32C taken at staging", key=bad, rank=of.rank)
            done = ReceivedStep(of, manifest, names, lengths, [])
            done.scattered, done.in_place_bytes = True, in_place
            return done
        if self._fits(spare, lengths):
            buffers = spare[:]
            spare.clear()
        else:
            buffers = [HostBuffer(max(n, 4096)) for n in lengths]
        try:
            link.code(_OK, _ACCEPT, "the header's verdict")
            bad = self._recv_pieces(link, man, buffers, lengths, chunk)
            link.code(_CHECKSUM if bad is not None else _OK, _FINAL, "the final verdict")
        except BaseException:
            with self._lock:  # a piece may still land in them: freed at close()
                self._kept.extend(buffers)
            raise
        if bad is not None:
            for b in buffers:
                b.close()
            raise ReplicaError(f"the replica of rank {of.rank}'s step {of.step} from {link.who} has bytes that "
                               "differ from the CRC32C taken at staging; it is not kept", key=bad, rank=of.rank)
        return ReceivedStep(of, manifest, names, lengths, buffers)

    def _check_header(self, link: Link, nr: bytes, ns: bytes, head: bytes, manifest: bytes, tag: bytes,
                      want: ReplicaOf, any_step: bool) -> tuple[ReplicaOf, Manifest, list[str], list[int], int] | _Refusal:
        """What the header announces, or why it is not to be received."""
        expect = mac(self._key, b"head", self.formation.group_id.encode(), nr, ns, head, manifest)
        if not hmac.compare_digest(tag, expect):
            log.warning("zerostall replica group %r: %s sent a header that does not authenticate",
                        self.job_id, link.who)
            return _Refusal(_BAD_HEADER, f"{link.who} sent a step header that does not authenticate under the "
                            "job secret")
        try:  # authenticated, so a keeper of this job wrote it; still checked before it is used
            d = json.loads(head)
            of = ReplicaOf(str(d["run"]), int(d["world"]), int(d["rank"]), int(d["step"]))
            files = [(str(f[0]), int(f[1])) for f in d["files"]]
            chunk = int(d["chunk"])
            ids = (d["job"], d["group"], d["from"], d["to"])
        except (ValueError, KeyError, TypeError, IndexError):
            return _Refusal(_BAD_HEADER, f"{link.who} sent a header that is not a step header")
        if ids != (self.job_id, self.formation.group_id, link.src, link.dst):
            return _Refusal(_BAD_HEADER, f"{link.who} sent a header for another transfer")
        if (of.run_id, of.world, of.rank) != (want.run_id, want.world, want.rank) or (
                not any_step and of.step != want.step):
            return _Refusal(_UNEXPECTED, f"{link.who} sent run {of.run_id!r} world {of.world} rank {of.rank} "
                            f"step {of.step}, expected run {want.run_id!r} world {want.world} rank {want.rank}"
                            + ("" if any_step else f" step {want.step}"))
        try:
            man = parse_manifest(manifest, path=f"replica:rank{of.rank}/step{of.step}")
        except ZerostallError as exc:  # malformed, or a format this library does not read
            return _Refusal(_UNEXPECTED, f"{link.who} sent a manifest that does not parse: {exc}")
        names, lengths = [n for n, _ in files], [n for _, n in files]
        if [(f.path.rsplit("/", 1)[-1], f.size) for f in man.files] != files:
            return _Refusal(_UNEXPECTED, f"{link.who} sent files {files} that are not its manifest's")
        unchecked = [lf.key for lf in man.leaves if lf.crc32c is None and lf.nbytes]
        if unchecked:
            return _Refusal(_UNEXPECTED, f"leaf {unchecked[0]!r} has no CRC32C in the manifest: a replica cannot "
                            "be verified")
        if not 1 << 20 <= chunk <= 1 << 30:
            return _Refusal(_UNEXPECTED, f"{link.who} announced pieces of {chunk} bytes")
        return of, man, names, lengths, chunk

    def _recv_pieces(self, link: Link, man: Manifest, buffers: list[HostBuffer], lengths: list[int],
                     chunk: int) -> str | None:
        """Receive every piece into ``buffers``, checksumming each beside the next ones; the key
        of the first leaf whose CRC32C differs, or None."""
        torch = self._torch
        plan = _plan(lengths, chunk)
        crcs_of = _LeafSpans(man, len(lengths))
        whole = [torch.frombuffer(b.view, dtype=torch.uint8) for b in buffers]
        jobs: list[Future[list[tuple[Span, int]]]] = []

        def crcs(fi: int, a: int, n: int) -> list[tuple[Span, int]]:
            return crcs_of(fi, a, buffers[fi].view[a:a + n])

        posted: list[tuple[Any, int, int, int]] = []
        nxt = 0
        while nxt < len(plan) or posted:
            while nxt < len(plan) and len(posted) < WINDOW:
                fi, a, n = plan[nxt]
                posted.append((link.recv(whole[fi][a:a + n], _CHUNK0 + nxt), fi, a, n))
                nxt += 1
            w, fi, a, n = posted.pop(0)
            link.wait(w, "receiving a piece")
            jobs.append(self._threads.submit(crcs, fi, a, n))
        return _first_bad(man, [p for j in jobs for p in j.result()])

    def _recv_scattered(self, link: Link, man: Manifest, scatter: Scatter, lengths: list[int],
                        chunk: int) -> tuple[str | None, int]:
        """:meth:`_recv_pieces` into ``scatter``'s memory: a piece inside one of its ranges is
        received straight there; any other (a file's header, padding, small leaves, a range's
        edge) into one of a few reused buffers, checksummed, and its bytes that belong to a
        range copied there. Returns what :meth:`_recv_pieces` does and the bytes received in place."""
        torch = self._torch
        regions = scatter.regions
        starts = [[st for st, _, _ in regs] for regs in regions]
        views = [[torch.frombuffer(m, dtype=torch.uint8) if len(m) else None for _, _, m in regs] for regs in regions]
        crcs_of = _LeafSpans(man, len(lengths))
        slots: list[Any] = []  # uint8 tensors of ``chunk`` bytes, allocated as first needed
        slot_jobs: dict[int, Future[list[tuple[Span, int]]]] = {}
        jobs: list[Future[list[tuple[Span, int]]]] = []

        def inside(fi: int, a: int, n: int) -> Any:
            k = bisect.bisect_right(starts[fi], a) - 1
            if k >= 0:
                st, end, _ = regions[fi][k]
                view = views[fi][k]
                if a + n <= end and view is not None:
                    return view[a - st:a - st + n]
            return None

        in_flight: set[int] = set()  # slots a posted receive writes into

        def take_slot() -> int:
            idle = [i for i in range(len(slots)) if i not in in_flight]
            for i in idle:
                j = slot_jobs.get(i)
                if j is None or j.done():
                    return i
            if len(slots) < WINDOW + 1:
                slots.append(torch.empty(chunk, dtype=torch.uint8))
                return len(slots) - 1
            slot_jobs[idle[0]].result()  # every idle slot is being checked: wait for one (at most
            return idle[0]               # WINDOW - 1 are in flight while a piece is posted)

        def check(fi: int, a: int, n: int, t: Any, bounced: bool) -> list[tuple[Span, int]]:
            mem = memoryview(t.numpy()).cast("B")
            out = crcs_of(fi, a, mem)
            if bounced:  # copy out what the load wants of it
                k = max(0, bisect.bisect_right(starts[fi], a) - 1)
                for st, end, dest in regions[fi][k:]:
                    if st >= a + n:
                        break
                    lo, hi = max(a, st), min(a + n, end)
                    if lo < hi:
                        dest[lo - st:hi - st] = mem[lo - a:hi - a]
            return out

        posted: list[tuple[Any, int, int, int, Any, int | None]] = []
        plan = _plan(lengths, chunk)
        nxt = in_place = 0
        while nxt < len(plan) or posted:
            while nxt < len(plan) and len(posted) < WINDOW:
                fi, a, n = plan[nxt]
                t = inside(fi, a, n)
                slot = None
                if t is None:
                    slot = take_slot()
                    in_flight.add(slot)
                    t = slots[slot][:n]
                else:
                    in_place += n
                posted.append((link.recv(t, _CHUNK0 + nxt), fi, a, n, t, slot))
                nxt += 1
            w, fi, a, n, t, slot = posted.pop(0)
            link.wait(w, "receiving a piece")
            job = self._threads.submit(check, fi, a, n, t, slot is not None)
            jobs.append(job)
            if slot is not None:
                in_flight.discard(slot)
                slot_jobs[slot] = job
        return _first_bad(man, [p for j in jobs for p in j.result()]), in_place


def _plan(lengths: Sequence[int], chunk: int) -> list[tuple[int, int, int]]:
    """The pieces of a transfer, in order: (file index, offset, length), as the sender cuts them."""
    return [(fi, a, min(chunk, n - a)) for fi, n in enumerate(lengths) for a in range(0, n, chunk)]


class _LeafSpans:
    """The CRC32Cs of the leaves' parts that a piece holds: ``(fi, a, piece bytes)`` ->
    ``[((leaf, start in leaf, end in leaf), crc), ...]``."""

    def __init__(self, man: Manifest, files: int) -> None:
        self.by_file: list[list[tuple[int, int, int]]] = [[] for _ in range(files)]  # (offset, end, leaf)
        for li, lf in enumerate(man.leaves):
            if lf.nbytes:
                self.by_file[lf.file].append((lf.offset, lf.offset + lf.nbytes, li))
        for spans in self.by_file:
            spans.sort()
        self.ends = [[e for _, e, _ in spans] for spans in self.by_file]

    def __call__(self, fi: int, a: int, mem: memoryview) -> list[tuple[Span, int]]:
        out: list[tuple[Span, int]] = []
        n = len(mem)
        for off, end, li in self.by_file[fi][bisect.bisect_right(self.ends[fi], a):]:
            if off >= a + n:
                break
            lo, hi = max(a, off), min(a + n, end)
            out.append(((li, lo - off, hi - off), checksum(mem[lo - a:hi - a])))
        return out


def _first_bad(man: Manifest, parts: list[tuple[Span, int]]) -> str | None:
    """The key of the first leaf whose CRC32C differs from the manifest's, or None."""
    got = join_crcs(parts, len(man.leaves))
    for lf, crc in zip(man.leaves, got, strict=True):
        if lf.nbytes and crc != lf.crc32c:
            return lf.key
    return None
