"""Hardware floors for the same bytes: what any checkpointer's numbers are divided by.

* ``memcpy``: copy every tensor of the state into preallocated, already faulted-in host buffers
  (one flat buffer, tensor views at 64-byte aligned offsets) -- the floor for the stall.
  ``memcpy_fresh`` copies into freshly allocated tensors instead (``clone``, first repeat only);
  it is reported to show what page faults cost, not as a floor.
* ``write_fsync``: one new file in the benchmark directory, the state's bytes written with
  64 MiB ``write`` calls, then ``fsync`` of the file and the directory -- the floor for persist.
* ``write_direct_fsync`` (informational): the same with ``O_DIRECT`` (no page-cache copy), the
  disk's own ceiling; a writer that uses ``O_DIRECT`` can beat the buffered floor above.
* ``read_warm``: ``readinto`` the same preallocated buffer with 64 MiB reads while the file is
  in the page cache -- the floor for an in-place restore of a checkpoint just written.
* ``read_cold``: the same after ``POSIX_FADV_DONTNEED`` -- the floor for a cold restore.

Run alone: ``python -m benchmarks.floors --size 256M --repeats 1 --dir /tmp/zsb``.
"""

from __future__ import annotations

import argparse
import mmap
import os
from pathlib import Path
from typing import Any

import torch

from benchmarks import measure
from benchmarks.state import build_state, flat_views, nbytes, parse_size

CHUNK = 64 << 20  # large enough that per-syscall overhead is noise, small enough to stream


def _write_file(path: Path, buf: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pos = 0
        while pos < len(buf):
            pos += os.write(fd, buf[pos : pos + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    measure.fsync_dir(path.parent)


def _write_file_direct(path: Path, buf: memoryview, length: int) -> bool:
    """O_DIRECT write of buf (page-aligned, whole pages) then truncate to length; False if the
    filesystem refuses O_DIRECT."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        pos = 0
        while pos < len(buf):
            pos += os.write(fd, buf[pos : pos + CHUNK])
        os.ftruncate(fd, length)
        os.fsync(fd)
    finally:
        os.close(fd)
    measure.fsync_dir(path.parent)
    return True


def _read_file(path: Path, buf: memoryview) -> int:
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < len(buf):
            n = f.readinto(buf[pos : pos + CHUNK])
            if not n:
                break
            pos += n
    return pos


def run(state: Any, directory: Path, repeats: int) -> dict[str, Any]:
    """Measure all floors ``repeats`` times on ``state``; returns lists of seconds per floor."""
    total = nbytes(state)
    flat, pairs = flat_views(state)
    for src, dst in pairs:  # one untimed pass: caches, thread pool, lazy init
        dst.copy_(src)
    out: dict[str, Any] = {"nbytes": total, "memcpy_s": [], "memcpy_fresh_s": [],
                           "write_fsync_s": [], "write_direct_fsync_s": [], "read_warm_s": [], "read_cold_s": []}
    # The file holds exactly the state's bytes (not the alignment padding of the buffer).
    payload = memoryview(flat.numpy())[: sum(t.numel() * t.element_size() for t, _ in pairs)]
    readbuf = memoryview(flat.numpy())[: len(payload)]
    for r in range(repeats):
        measure.wait_for_quiet(max_wait_s=measure.QUIET_WAIT_S)
        t0 = measure.now()
        for src, dst in pairs:
            dst.copy_(src)
        out["memcpy_s"].append(measure.now() - t0)

        if r == 0:
            # Only the first clone is "fresh": after it, the allocator hands back the pages it
            # just freed (glibc raises its mmap threshold), so later clones are warm copies.
            t0 = measure.now()
            fresh = [src.clone() for src, _ in pairs]
            out["memcpy_fresh_s"].append(measure.now() - t0)
            del fresh

        npay = len(payload)
        direct_buf = memoryview(flat.numpy())[: (npay + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE]
        path = measure.scratch_path(directory, "floor-direct")
        try:
            t0 = measure.now()
            if _write_file_direct(path, direct_buf, npay):
                out["write_direct_fsync_s"].append(measure.now() - t0)
        finally:
            measure.remove(path)

        path = measure.scratch_path(directory, "floor")
        try:
            t0 = measure.now()
            _write_file(path, payload)
            out["write_fsync_s"].append(measure.now() - t0)

            t0 = measure.now()
            got = _read_file(path, readbuf)
            out["read_warm_s"].append(measure.now() - t0)
            assert got == len(payload), (got, len(payload))

            measure.drop_cache(path)
            t0 = measure.now()
            _read_file(path, readbuf)
            out["read_cold_s"].append(measure.now() - t0)
        finally:
            measure.remove(path)
        measure.log(
            f"floors r{r}: memcpy {out['memcpy_s'][-1]:.3f}s write+fsync "
            f"{out['write_fsync_s'][-1]:.3f}s (O_DIRECT {(out['write_direct_fsync_s'] or [float('nan')])[-1]:.3f}s) read warm {out['read_warm_s'][-1]:.3f}s "
            f"cold {out['read_cold_s'][-1]:.3f}s"
        )
    out["torch_threads"] = torch.get_num_threads()
    return out


def child_args(description: str) -> argparse.ArgumentParser:
    """The arguments every benchmark child process takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--size", default="256M", help="target state size, e.g. 256M, 1G, 4G")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dir", default="/tmp/zerostall-bench", help="scratch directory on the disk under test")
    return p


def main() -> None:
    args = child_args(__doc__.splitlines()[0]).parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = build_state(parse_size(args.size))
    measure.emit(run(state, directory, args.repeats))


if __name__ == "__main__":
    main()
