"""One save, as the writer runs it: write data files, checksum leaves, commit, apply retention."""

from __future__ import annotations

import os
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import crc32c

from zerostall import __version__
from zerostall.commit import committed_steps, delete_checkpoint, protocol_for, step_name, steps_to_delete
from zerostall.manifest import encode_manifest
from zerostall.persist import faults
from zerostall.storage import open_storage

__all__ = ["run_job", "checksum", "apply_retention", "peak_rss"]


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: unlike ru_maxrss, reset at exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def checksum(view: memoryview, value: int = 0) -> int:
    """CRC32C of ``view``, continuing from ``value`` (hardware-accelerated; releases the GIL)."""
    return int(crc32c.crc32c(view, value))


def apply_retention(storage: Any, retention: dict[str, Any] | None, deleted: list[int] | None = None) -> list[int]:
    """Delete the committed steps that ``retention`` (step, keep_last, keep_every_n_steps) drops.

    Returns the deleted steps; they are also appended to ``deleted`` as they go, so a caller
    that catches a failure half-way still knows what was removed.
    """
    out = [] if deleted is None else deleted
    if not retention:
        return out
    faults.hit("retention")
    doomed = steps_to_delete(committed_steps(storage), newest=retention["step"],
                             keep_last=retention.get("keep_last"),
                             keep_every_n_steps=retention.get("keep_every_n_steps"))
    for s in doomed:
        delete_checkpoint(storage, step_name(s))
        out.append(s)
    return out


def run_job(job: dict[str, Any], buffers: dict[int, memoryview], released: Callable[[], None]) -> dict[str, Any]:
    """Persist and commit one save; call ``released()`` as soon as the buffers are no longer read.

    Returns statistics. Raises on failure after removing this attempt's partial files.
    """
    if job.get("dist") is not None:  # one rank's part of a torch.distributed save
        from zerostall.dist.job import run_dist_job

        return run_dist_job(job, buffers, released)
    t0 = time.perf_counter()
    env = job.get("env")
    if env is not None:  # mirror the trainer's storage environment (credentials, endpoint)
        for k in [k for k in os.environ if k.startswith(("AWS_", "ZEROSTALL_S3_")) and k not in env]:
            del os.environ[k]
        os.environ.update(env)
    storage = open_storage(job["root"])
    protocol = protocol_for(storage)
    opts = job["options"]
    faults.hit("begin", job["root"])
    attempt = protocol.begin(job["name"])
    try:
        files = job["files"]
        leaves = job["leaves"]
        views = [buffers[f["buffer"]] for f in files]
        crcs: list[int] = [0] * len(leaves)

        def do_checksums() -> None:
            faults.hit("checksum")
            for i, lf in enumerate(leaves):
                v = views[lf["file"]]
                crcs[i] = checksum(v[lf["offset"]:lf["offset"] + lf["nbytes"]])

        # Checksums run beside the writes: CRC32C is ~10 GB/s on one core and mostly overlaps I/O.
        crc_error: list[BaseException] = []

        def crc_runner() -> None:
            try:
                do_checksums()
            except BaseException as exc:  # re-raised below on the job's thread
                crc_error.append(exc)

        crc_thread = threading.Thread(target=crc_runner, name="zerostall-crc", daemon=True)
        crc_thread.start()
        t_write = time.perf_counter()
        faults.hit("write", job["root"])

        def write_file(i: int) -> None:
            f = files[i]
            storage.write_from_buffer(
                f"{attempt.staging}/{attempt.data_dir}/{f['name']}", views[i], f["length"],
                threads=opts["io_threads"], chunk_bytes=opts["chunk_bytes"], direct=opts["direct_io"])

        try:
            if len(files) == 1:
                write_file(0)
            else:
                with ThreadPoolExecutor(max_workers=min(4, len(files))) as pool:
                    list(pool.map(write_file, range(len(files))))
        finally:
            crc_thread.join()
        write_s = time.perf_counter() - t_write
        released()
        if crc_error:
            raise crc_error[0]
        for lf, c in zip(leaves, crcs):
            lf["crc32c"] = c

        faults.hit("manifest")
        t_commit = time.perf_counter()
        manifest = encode_manifest(
            items=job["items"], leaves=leaves, metadata=job.get("metadata"), library_version=__version__,
            files=[{"path": f"{attempt.data_dir}/{f['name']}", "size": f["length"]} for f in files],
        )
        faults.hit("commit")
        protocol.commit(attempt, manifest)
        commit_s = time.perf_counter() - t_commit
    except BaseException:
        try:
            protocol.abort(attempt)
        except Exception:
            pass
        raise

    retention = job.get("retention")
    deleted: list[int] = []
    retention_error: str | None = None
    if retention:
        # The save is committed: a failure here only leaves old steps behind (the next save's
        # retention retries them). It is reported in the stats and logged, not raised.
        try:
            apply_retention(storage, retention, deleted)  # fills `deleted` as it goes
        except Exception as exc:
            retention_error = f"{type(exc).__name__}: {exc}"

    nbytes = sum(f["length"] for f in files)
    return {
        "nbytes": nbytes,
        "write_s": write_s,
        "commit_s": commit_s,
        "persist_s": time.perf_counter() - t0,
        "writer_peak_rss": peak_rss(),
        "deleted_steps": deleted,
        "retention_error": retention_error,
    }
