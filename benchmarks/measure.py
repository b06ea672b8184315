"""Measurement primitives shared by the benchmark modules: clocks, cache dropping, RSS sampling,
scratch paths and the child-process result protocol.

Kept free of any system under test so that every system is timed with the same code.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

#: Marker of the one result line a child process prints on stdout; everything else a child
#: prints (library warnings, progress) is passed through to the user's terminal.
RESULT_MARKER = "@@ZS-BENCH-RESULT "

now = time.perf_counter


def median(xs: Iterable[float | None]) -> float | None:
    """Median of the non-None values, None if there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def drop_cache(path: str | os.PathLike[str]) -> None:
    """Evict a file, or every file under a directory, from the page cache.

    ``POSIX_FADV_DONTNEED`` only drops clean pages, so callers fsync before (every writer
    measured here fsyncs before it reports completion). This affects the guest page cache
    only; a hypervisor cache below the virtio disk may still serve "cold" reads.
    """
    p = Path(path)
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # no-op when already clean; makes DONTNEED effective if not
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(path: str | os.PathLike[str]) -> None:
    """Read a file, or every file under a directory, once, so that it is in the page cache.

    "Warm" restores are timed after this: a system that writes or reads with ``O_DIRECT``
    (zerostall does both for large ranges) leaves nothing in the page cache by itself.
    """
    p = Path(path)
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    buf = bytearray(8 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def raw_read(path: str | os.PathLike[str], buf: memoryview) -> float:
    """Seconds to read every file under ``path`` sequentially into ``buf`` (reused), 64 MiB a call.

    The paired cold-read floor: the same bytes, in the same files, as the restore beside it, so
    that where the files came from (buffered or direct writes, one file or many) cancels out.
    """
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    t0 = now()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            off = 0
            while True:
                n = os.preadv(fd, [buf], off)
                if n == 0:
                    break
                off += n
        finally:
            os.close(fd)
    return now() - t0


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync every file and directory under path (for writers that do not fsync themselves)."""
    p = Path(path)
    if p.is_file():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(p.parent)
        return
    for f in p.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(p)
    fsync_dir(p.parent)


def scratch_path(base: str | os.PathLike[str], stem: str) -> Path:
    """A fresh, not yet existing path under base (checkpoint APIs refuse existing targets)."""
    return Path(base) / f"{stem}-{uuid.uuid4().hex[:8]}"


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint file or directory; missing is fine (disk space matters here)."""
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _cpu_jiffies() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already counted in user
    return (total - idle) / hz, total / hz


def _own_cpu_s() -> float:
    """CPU seconds used by this process and its descendants (live and reaped)."""
    p = psutil.Process()
    t = p.cpu_times()
    own = t.user + t.system + t.children_user + t.children_system
    for c in p.children(recursive=True):
        try:
            ct = c.cpu_times()
            own += ct.user + ct.system
        except psutil.Error:
            pass
    return own


class ForeignLoad:
    """Measures how many cores *other* users of the machine kept busy during a block.

    The development machine is shared: other engineers' test runs take cores at random. The
    machine's busy CPU time minus this process tree's CPU time, divided by the wall time, is
    the average number of cores someone else used; a measurement taken under foreign load is
    flagged with it instead of being silently trusted.
    """

    def __enter__(self) -> ForeignLoad:
        self._busy0, _ = _cpu_jiffies()
        self._own0 = _own_cpu_s()
        self._t0 = now()
        self.cores = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        busy1, _ = _cpu_jiffies()
        own1 = _own_cpu_s()
        wall = now() - self._t0
        self.cores = max(0.0, ((busy1 - self._busy0) - (own1 - self._own0)) / wall) if wall > 0 else 0.0


#: How long a save or restore measurement waits for the machine to quieten before going ahead.
QUIET_WAIT_S = 1.0


def wait_for_quiet(max_wait_s: float = 20.0, busy_cores: float = 0.3, probe_s: float = 0.5) -> dict[str, float]:
    """Wait (up to ``max_wait_s``) until the other users of the machine use < ``busy_cores``.

    Returns how long it waited and the foreign load of the last probe, to be stored with the
    measurement that follows; after ``max_wait_s`` the measurement goes ahead anyway (a run
    must finish), flagged by that load.
    """
    start = now()
    while True:
        with ForeignLoad() as fl:
            time.sleep(probe_s)
        if fl.cores < busy_cores or now() - start >= max_wait_s:
            return {"quiet_wait_s": now() - start, "foreign_cores_before": fl.cores}


def _tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(rss of proc, summed rss of all its descendants); vanished children count as 0."""
    own = proc.memory_info().rss
    kids = 0
    for c in proc.children(recursive=True):
        try:
            kids += c.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return own, kids


@dataclass
class RssSampler:
    """Samples the RSS of this process and of its descendants on a background thread.

    RSS counts shared-memory pages in every process that touched them, so a trainer and a
    writer sharing a staging buffer both show it; report the two separately, never summed.
    The 20 ms period is a compromise: short enough to catch a multi-GiB peak that lasts a
    fraction of a second, long enough that the sampler's own GIL time does not show in timings.
    """

    period_s: float = 0.02
    baseline_trainer: int = 0
    peak_trainer: int = 0
    peak_children: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        self._proc = psutil.Process()
        self.baseline_trainer, self.peak_children = _tree_rss(self._proc)
        self.peak_trainer = self.baseline_trainer
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self) -> None:
        try:
            own, kids = _tree_rss(self._proc)
        except psutil.Error:
            return
        self.peak_trainer = max(self.peak_trainer, own)
        self.peak_children = max(self.peak_children, kids)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def as_dict(self) -> dict[str, int]:
        return {
            "trainer_rss_baseline": self.baseline_trainer,
            "trainer_rss_peak": self.peak_trainer,
            "trainer_rss_extra": self.peak_trainer - self.baseline_trainer,
            "children_rss_peak": self.peak_children,
        }


def emit(result: dict[str, Any]) -> None:
    """Print a child's result as the single marked JSON line the parent looks for."""
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(result), flush=True)


def report(summary: dict[str, Any], lines: list[str], out: str | None) -> None:
    """A benchmark's end: its lines on stdout (kept in ``summary["lines"]``), the summary JSON to
    ``out`` if given, then the marked result line."""
    summary["lines"] = lines
    for line in lines:
        print(line, flush=True)
    if out:
        Path(out).write_text(json.dumps(summary, indent=1))
    emit(summary)


def parse_child_output(stdout: str) -> dict[str, Any] | None:
    """Find the marked JSON line in a child's stdout; None if the child died before it."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    return None


def log(msg: str) -> None:
    """Progress to stderr so stdout stays parseable."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The save/restore loop every checkpointing system (zerostall and peers) is measured with.


class Pending:
    """What a system's ``save`` returns: the caller may mutate the state again, and
    :meth:`wait` blocks until the checkpoint is durable, returning optional extra stats."""

    def wait(self) -> dict[str, Any] | None:  # pragma: no cover - interface
        raise NotImplementedError


class Done(Pending):
    """A save that was already durable when ``save`` returned (blocking systems)."""

    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        self.extra = extra

    def wait(self) -> dict[str, Any] | None:
        return self.extra


class System:
    """A checkpointing system under test. Subclasses override the methods they need.

    ``save(path, state)`` must return only once the caller may mutate ``state`` again (that wait
    is the stall); ``Pending.wait()`` returns once the checkpoint is durable (fsynced and
    committed). ``restore(path, template)`` returns the restored tree; ``in_place`` says whether
    it fills ``template`` (True) or allocates new tensors (False).
    """

    name = "system"
    in_place = True

    def setup(self, directory: Path) -> None:
        pass

    def native(self, state: Any) -> Any:
        """The state as this system's own arrays, built once after ``setup`` and never timed;
        ``save`` gets this. The default is the torch tree itself."""
        return state

    def template(self, state: Any) -> Any:
        """The ``restore`` target for the torch ``state``: zero-filled tensors like it."""
        from benchmarks.state import template_like

        return template_like(state)

    def equal(self, state: Any, restored: Any) -> bool:
        """Whether ``restored`` holds exactly the torch ``state``'s keys and values (untimed)."""
        from benchmarks.state import trees_equal

        return trees_equal(state, restored)

    def save(self, path: Path, state: Any) -> Pending:
        raise NotImplementedError

    def restore(self, path: Path, template: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def restore_variants(self) -> dict[str, Any]:
        """Extra named restore functions ``(path, template) -> tree`` timed like ``restore``
        (e.g. with verification off, to show what verification costs)."""
        return {}


def _timed_restore(restore: Callable[[Path, Any], Any], path: Path, template: Any,
                   prepare_cache: Callable[[Path], None]) -> float:
    """Seconds for one ``restore(path, template)`` after ``prepare_cache`` (warm or drop) and a quiet wait."""
    prepare_cache(path)
    wait_for_quiet(max_wait_s=QUIET_WAIT_S)
    t0 = now()
    restored = restore(path, template)
    elapsed = now() - t0
    del restored  # freed before the next measurement allocates
    return elapsed


def measure_system(system: System, state: Any, directory: Path, repeats: int) -> dict[str, Any]:
    """First save, ``repeats`` later saves, a first restore, then ``repeats`` warm and cold restores.

    Right before every save the state is also copied into a warm preallocated buffer in this
    process (``memcpy_s``): a memcpy floor paired with that save, so that the stall ratio does
    not depend on what the other users of the shared machine did between the floors child and
    this one. ``state`` is the torch tree; a system with its own array type saves its
    ``native`` copy of it (the same bytes, converted once before the first save), while the
    memcpy floor and the correctness check keep using the torch tree.

    Every save goes to a new path (checkpointers refuse to overwrite); each checkpoint is deleted
    as soon as it is no longer needed so that 4 GiB runs do not fill the disk. The last one is
    kept for the restores: warm (``warm_cache`` reads its files right before), then cold
    (``drop_cache`` before every read), each cold restore followed by a raw sequential read of the
    same files, also cold: the paired cold-read floor.
    """
    from benchmarks.state import flat_views, nbytes

    out: dict[str, Any] = {"system": system.name, "nbytes": nbytes(state), "in_place": system.in_place}
    system.setup(directory)
    native = system.native(state)
    saves: list[dict[str, Any]] = []
    path: Path | None = None
    flat, pairs = flat_views(state)
    for src, dst in pairs:
        dst.copy_(src)
    try:
        for r in range(repeats + 1):  # r == 0 is the first save: allocations, process start
            if path is not None:
                remove(path)
            path = scratch_path(directory, system.name)
            quiet = wait_for_quiet(max_wait_s=QUIET_WAIT_S)
            with ForeignLoad() as foreign:
                tm = now()
                for src, dst in pairs:
                    dst.copy_(src)
                memcpy_s = now() - tm
                with RssSampler() as mem:
                    t0 = now()
                    pending = system.save(path, native)
                    t1 = now()
                    extra = pending.wait()
                    t2 = now()
            m = {"stall_s": t1 - t0, "commit_s": t2 - t0, "persist_s": t2 - t1, "memcpy_s": memcpy_s,
                 **mem.as_dict(), **quiet, "foreign_cores": foreign.cores}
            if extra:
                m["extra"] = extra
            m["disk_bytes"] = sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file())
            saves.append(m)
            log(f"{system.name} save {'first' if r == 0 else r}: stall {m['stall_s']:.3f}s "
                f"commit {m['commit_s']:.3f}s trainer +{m['trainer_rss_extra'] / 2**20:.0f} MiB "
                f"children peak {m['children_rss_peak'] / 2**20:.0f} MiB; others used {m['foreign_cores']:.1f} cores")
        out["first_save"] = saves[0]
        out["saves"] = saves[1:]
        del flat, pairs  # free the floor buffer before the restore template is allocated

        assert path is not None
        template = system.template(state)
        # The first restore of a process pays one-time costs (imports, thread pools); it is
        # what a job restarting from a checkpoint pays, so it is reported, but separately.
        t0 = now()
        restored = system.restore(path, template)
        out["restore_first_s"] = now() - t0
        out["restore_correct"] = system.equal(state, restored)  # untimed: a fast wrong restore is no result
        del restored
        warm, cold, raw_warm, raw_cold = [], [], [], []
        # page-aligned: a read() into a bytearray (16 bytes off a 64-byte boundary) ran at half
        # speed on this VM, which made this floor slower than it is
        read_buf = memoryview(mmap.mmap(-1, 64 << 20))
        read_buf[:] = bytes(len(read_buf))  # faulted in here, not in the first timed read
        for r in range(repeats):
            warm.append(_timed_restore(system.restore, path, template, warm_cache))
            # The paired warm floor: the same files read the same way right after, under the same
            # conditions (warmed, then a quiet wait). The floors child reads a file it has just
            # written, with no wait: hotter caches and clocks than any restore here gets.
            warm_cache(path)
            wait_for_quiet(max_wait_s=QUIET_WAIT_S)
            raw_warm.append(raw_read(path, read_buf))
            cold.append(_timed_restore(system.restore, path, template, drop_cache))
            drop_cache(path)
            wait_for_quiet(max_wait_s=QUIET_WAIT_S)
            raw_cold.append(raw_read(path, read_buf))
            log(f"{system.name} restore {r}: warm {warm[-1]:.3f}s cold {cold[-1]:.3f}s")
        out["restore_warm_s"] = warm
        out["restore_cold_s"] = cold
        out["read_warm_paired_s"] = raw_warm
        out["read_cold_paired_s"] = raw_cold
        for vname, fn in system.restore_variants().items():
            vw, vc = [], []
            for r in range(repeats):
                vw.append(_timed_restore(fn, path, template, warm_cache))
                vc.append(_timed_restore(fn, path, template, drop_cache))
                log(f"{system.name} restore {vname} {r}: warm {vw[-1]:.3f}s cold {vc[-1]:.3f}s")
            out.setdefault("restore_variants", {})[vname] = {"warm_s": vw, "cold_s": vc}
    finally:
        if path is not None:
            remove(path)
        system.close()
    return out


@contextlib.contextmanager
def job_scratch(prefix: str) -> Iterator[tuple[Path, Any]]:
    """A scratch directory and, in it, the log the job's processes write their stderr to; if the
    block fails, the log's tail goes to this process's stderr before the directory is removed."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, open(Path(tmp) / "log.txt", "w") as log:
        try:
            yield Path(tmp), log
        except BaseException:
            log.flush()
            print((Path(tmp) / "log.txt").read_text()[-4000:], file=sys.stderr)
            raise


def host_rank_env(host: str, port: int, root: Path) -> dict[str, str]:
    """A rank's environment on simulated host ``host`` (``ZEROSTALL_HOST_ID``) of a job whose store
    is at 127.0.0.1:``port``, importing ``benchmarks`` and ``zerostall`` from ``root``."""
    return dict(os.environ, OMP_NUM_THREADS="1", ZEROSTALL_HOST_ID=f"bench-host-{host}",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                PYTHONPATH=os.pathsep.join([str(root), str(root / "src"), os.environ.get("PYTHONPATH", "")]))
