"""Loads into accelerator (CUDA) templates: read, checksum and send to the device in one pass.

A template on a CUDA device cannot be read into: its bytes pass through host memory. Before,
each such leaf was read into a fresh pageable host tensor (the GPU benchmark's 4.74 GB state:
4.74 GB of new pages, faulted in as they were written), and once everything had verified, copied
over with one synchronous ``copy_`` per leaf (``benchmarks/gpu_restore.py`` on one H200: 1.13 s
warm, against 0.83 s for safetensors and a host-to-device floor of 0.09 s; docs/performance.md).

Now the pass's threads each own a small ring: two page-locked buffers of :data:`PIECE` bytes and a
stream of their own. A thread reads a piece of the data file (``Storage.read_into``: neighbouring
small leaves together) into one of its buffers, checksums it there while it is in cache, and sends
it to the device with a ``non_blocking`` copy on its stream; that buffer is read into again only
once its copy is done (an event). The host holds a few pieces at a time, whatever the state's size.

All or nothing (``LoadOptions.atomic``): the pieces go to one scratch tensor on each device, and
only the commit writes the templates, device to device on the caller's current stream, once every
leaf has verified (and, in a collective load, every rank). Without room for the scratch on the
device (its free memory under the bytes held back plus :data:`DEVICE_MARGIN`), the bytes are held
in host memory and the commit copies them over, as before. A load that is not all or nothing sends
the pieces straight into the templates.

Which templates come here is the planner's choice (``restore.plan``: ``ReadRequest.device``;
``ZEROSTALL_DEVICE_LOADS=0`` plans CUDA templates through a host tensor per leaf instead, an A/B
a GPU run has yet to decide: :mod:`zerostall.envvars`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from zerostall.checksum import checksum
from zerostall.format.manifest import LeafEntry
from zerostall.restore.plan import ReadRequest
from zerostall.restore.spans import Span, join_crcs, run_all, split_chunks, workers
from zerostall.storage import Storage

__all__ = ["PIECE", "DEVICE_MARGIN", "prepare_device_reads"]

log = logging.getLogger("zerostall")

#: The unit a thread reads, checksums and sends: small enough that two per thread stay cheap to pin
#: and the checksum finds the bytes in cache, large enough that a copy's fixed cost is noise.
PIECE = 8 << 20

#: What a piece may span beyond :data:`PIECE`: the gaps between the neighbouring leaves packed into
#: it (``restore.read._group``: under a page each, at most 256 leaves a run).
_SLACK = 256 * 4096

#: Free device memory an all-or-nothing load leaves beside its scratch (the caller's next
#: allocations, the allocator's rounding).
DEVICE_MARGIN = 256 << 20

#: Scratch offsets are rounded up to this, so that every leaf's copy starts aligned.
_ALIGN = 512


class Checks(Protocol):
    """What the pass needs from the load's reader (``restore.read._Reader``)."""

    def key(self, leaf: LeafEntry) -> str: ...
    def fail(self, exc: BaseException, leaf: LeafEntry) -> BaseException: ...
    def check(self, r: ReadRequest, got: int) -> None: ...
    def read_fresh(self, reqs: list[ReadRequest]) -> None: ...


class _Ring:
    """One thread's page-locked buffers, their events and its stream (None on the CPU)."""

    def __init__(self, torch: Any, device: Any) -> None:
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        self.size = PIECE + _SLACK
        self.bufs = [torch.empty(self.size, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.views = [memoryview(b.numpy()).cast("B") for b in self.bufs]
        self.events: list[Any] = [None, None]
        self.next = 0

    def take(self) -> int:
        """The buffer to read into next, once the copy it last fed is done."""
        i = self.next
        self.next ^= 1
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
            self.events[i] = None
        return i

    def sent(self, torch: Any, i: int) -> None:
        if self.stream is not None:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.events[i] = ev

    def drain(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.events = [None, None]


#: Rings kept between loads, per device: allocated once (page-locking costs milliseconds per MiB)
#: and reused, like the save path's staging buffers.
_RINGS: dict[tuple[Any, int], list[_Ring]] = {}
_RINGS_LOCK = threading.Lock()


def _take_rings(torch: Any, device: Any, n: int) -> list[_Ring]:
    with _RINGS_LOCK:
        free = _RINGS.setdefault((device, PIECE + _SLACK), [])
        got = [free.pop() for _ in range(min(n, len(free)))]
    return got + [_Ring(torch, device) for _ in range(n - len(got))]


def _give_back(device: Any, rings: list[_Ring]) -> None:
    with _RINGS_LOCK:
        for ring in rings:
            _RINGS.setdefault((device, ring.size), []).append(ring)


def _flat(t: Any) -> Any:
    """The template's bytes as a flat uint8 tensor on its device (a view: ``t`` is contiguous)."""
    return t.detach().reshape(-1).view(sys.modules["torch"].uint8)


Grouping = Callable[[list[ReadRequest], int], list[list[ReadRequest]]]


def prepare_device_reads(reader: Checks, storage: Storage, reqs: list[ReadRequest], *, verify: bool, hold: bool,
                         host_ok: Callable[[], bool], group: Grouping, io_threads: int) -> Callable[[], None]:
    """Read and check every device request now; return what writes the templates.

    ``hold``: all or nothing (the templates are written only by the returned callable, and only
    an I/O-free device-to-device copy is left for it). ``host_ok()``, asked only where a device
    has no room for the held bytes: whether they may wait in host memory instead (else they go
    straight in, not all or nothing; it logs why). ``group`` packs neighbouring leaves into runs
    of at most a piece (``restore.read._group``).

    Raises what the reads and checks raise (naming the leaf); no template has changed then when
    ``hold``.
    """
    torch = sys.modules["torch"]
    dests: dict[int, Any] = {}  # id(request) -> where its bytes go (a flat uint8 tensor)
    commits: list[tuple[Any, Any]] = []  # (template bytes, held bytes) for the commit
    host_held: list[ReadRequest] = []
    by_device: dict[Any, list[ReadRequest]] = {}
    for q in reqs:
        by_device.setdefault(q.device.device, []).append(q)
    for dev, qs in by_device.items():
        if not hold:
            for q in qs:
                dests[id(q)] = _flat(q.device)
            continue
        scratch = _device_scratch(torch, dev, qs)
        if scratch is None and not host_ok():
            for q in qs:  # no room anywhere to hold them back: straight in (host_ok() logged why)
                dests[id(q)] = _flat(q.device)
            continue
        if scratch is None:
            log.info("loading %d leaves into %s: no room on the device to hold them back until they verify; "
                     "held in host memory instead", len(qs), dev)
            host_held.extend(qs)
            continue
        pos = 0
        for q in qs:
            n = q.leaf.nbytes
            dests[id(q)] = scratch[pos:pos + n]
            commits.append((_flat(q.device), dests[id(q)]))
            pos += -(-n // _ALIGN) * _ALIGN
    if host_held:
        _hold_on_host(reader, host_held, commits)
    for dev, qs in by_device.items():
        sent = [q for q in qs if id(q) in dests]  # the rest were read into host memory above
        if sent:
            _send(torch, reader, storage, dev, sent, dests, verify, group, io_threads)

    def commit() -> None:
        streams = set()
        for dst, src in commits:
            dst.copy_(src, non_blocking=True)  # on the caller's current stream: after its work on dst
            if dst.device.type == "cuda":
                streams.add(dst.device)
        for dev in streams:
            torch.cuda.current_stream(dev).synchronize()
        commits.clear()
    return commit


def _device_scratch(torch: Any, dev: Any, qs: list[ReadRequest]) -> Any:
    """One uint8 tensor on ``dev`` for every held byte of ``qs``, or None without room for it."""
    need = sum(-(-q.leaf.nbytes // _ALIGN) * _ALIGN for q in qs)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        if free < need + DEVICE_MARGIN:
            return None
    try:
        return torch.empty(need, dtype=torch.uint8, device=dev)
    except RuntimeError:  # torch.cuda.OutOfMemoryError: another process took it meanwhile
        return None


def _hold_on_host(reader: Checks, qs: list[ReadRequest], commits: list[tuple[Any, Any]]) -> None:
    """The held bytes in host memory, read and checked by the load's own reads (grouped, vectored,
    ``O_DIRECT`` when cold); the commit copies them over."""
    torch = sys.modules["torch"]
    host = [torch.empty(q.leaf.nbytes, dtype=torch.uint8) for q in qs]
    reader.read_fresh([ReadRequest(q.leaf, memoryview(h.numpy()).cast("B"), q.verify)
                       for q, h in zip(qs, host, strict=True)])
    commits.extend((_flat(q.device), h) for q, h in zip(qs, host, strict=True))


def _send(torch: Any, reader: Checks, storage: Storage, dev: Any, qs: list[ReadRequest], dests: dict[int, Any],
          verify: bool, group: Grouping, io_threads: int) -> None:
    """Read ``qs`` piece by piece on every thread, each piece checksummed in its ring's buffer and
    sent to ``dests``; every leaf checked once all its pieces are in."""
    index = {id(q): i for i, q in enumerate(qs)}
    pieces = split_chunks([[(index[id(q)], q.leaf.nbytes) for q in g] for g in group(qs, PIECE)], PIECE)
    n = max(1, min(workers(io_threads), len(pieces)))
    rings = _take_rings(torch, dev, n)
    free: queue.SimpleQueue[_Ring] = queue.SimpleQueue()
    for ring in rings:
        if ring.stream is not None:  # the templates' earlier work (on the current stream) first
            ring.stream.wait_stream(torch.cuda.current_stream(dev))
        free.put(ring)

    def piece(k: int) -> list[tuple[Span, int]]:
        ring = free.get()
        try:
            return _send_piece(torch, reader, storage, qs, pieces[k], dests, verify, ring)
        finally:
            free.put(ring)

    settled = False  # every item has returned (run_all waits for all before it raises an item's error)
    try:
        parts = [p for got in run_all(piece, range(len(pieces)), n) for p in got]
        settled = True
    except Exception:
        settled = True
        raise
    finally:
        for ring in rings:
            ring.drain()  # every copy done before a buffer is reused or a scratch byte is trusted
        if settled:  # interrupted, an item may still hold a ring: those are not handed out again
            _give_back(dev, rings)
    if verify:
        for q, crc in zip(qs, join_crcs(parts, len(qs)), strict=True):
            if q.verify:
                reader.check(q, crc or 0)


def _send_piece(torch: Any, reader: Checks, storage: Storage, qs: list[ReadRequest], spans: Sequence[Span],
                dests: dict[int, Any], verify: bool, ring: _Ring) -> list[tuple[Span, int]]:
    first, last = qs[spans[0][0]].leaf, qs[spans[-1][0]].leaf
    start = first.offset + spans[0][1]
    end = last.offset + spans[-1][2]
    if end - start > ring.size:
        raise AssertionError(f"a piece of {end - start} bytes exceeds its buffer")  # _group's bound broke
    i = ring.take()
    view = ring.views[i][:end - start]
    try:  # the piece's leaves lie next to each other (gaps under a page): one read
        storage.read_into(reader.key(first), start, view)
    except (EOFError, OSError) as exc:
        raise reader.fail(exc, first) from exc
    out = []
    buf = ring.bufs[i]
    ctx = torch.cuda.stream(ring.stream) if ring.stream is not None else contextlib.nullcontext()
    with ctx:
        for s in spans:
            q = qs[s[0]]
            a = q.leaf.offset + s[1] - start
            b = a + s[2] - s[1]
            crc = checksum(view[a:b]) if verify and q.verify else 0
            dests[id(q)][s[1]:s[2]].copy_(buf[a:b], non_blocking=True)
            out.append((s, crc))
    ring.sent(torch, i)
    return out
