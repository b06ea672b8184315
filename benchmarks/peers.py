"""Peer checkpointers on the same state, measured with the same loop as zerostall.

Systems (``--system``):

* ``torch_save``: ``torch.save`` to one file, then ``fsync``; restore ``torch.load`` then
  ``copy_`` into the template (what ``load_state_dict`` does).
* ``safetensors``: ``safetensors.torch.save_file`` + ``fsync``; restore ``load_file`` then
  ``copy_`` into the template (``load_file`` maps the file lazily, so without the copy it would
  time an ``mmap``, not a restore).
* ``dcp_save``: ``torch.distributed.checkpoint.save`` (sync); restore ``dcp.load`` (in place).
* ``dcp_async``: default ``dcp.async_save`` (thread executor, fresh staging buffers every save).
* ``dcp_async_stager``: ``async_save`` with one persistent ``DefaultStager`` created with explicit
  CPU ``StagingOptions`` (no pinned/shared memory, no non-blocking copy: those need an
  accelerator) and asynchronous staging; its storages are cached, so later saves reuse them.
  The stall ends when staging completes (``staging_completion``), the point from which the
  caller may mutate its tensors -- the same contract as zerostall's return.
* ``dcp_async_cached``: ``async_save`` with ``FileSystemWriter(cache_staged_state_dict=True)``;
  on a CPU-only torch this is expected to fail (it pins memory); the error is recorded.
* ``dcp_async_process``: ``async_save`` with ``AsyncCheckpointerType.PROCESS`` (opt-in, slow).
* ``orbax_save``: Orbax v1 ``ocp.save`` (blocking), then ``fsync`` of every file and directory
  it wrote (Orbax fsyncs nothing itself; tensorstore's file driver may, the metadata files and
  the commit rename are not), ZSTD compression off (``use_compression = False``, as in the
  peer-numbers note's "Orbax without compression"); restore ``ocp.load`` into an abstract
  template (``jax.ShapeDtypeStruct`` with the CPU device's sharding): jax arrays are immutable,
  so the restore allocates new ones, ``in_place = False``.
* ``orbax_async``: ``ocp.save_async``; the stall ends when it returns, the commit when
  ``response.result()`` has returned and the files are fsynced. Before returning, Orbax has
  taken a host copy of every array -- on the CPU backend a zero-copy, read-only numpy view
  (``np.asarray``), so the stall contains no memcpy. That is safe because a jax array is never
  mutated in place: a jitted step that donates it while the view is alive is silently not
  donated (jax 0.10.2 on CPU; new output buffers instead), so the checkpoint stays intact.

  Both use the v1 free functions ``save``/``save_async``/``load`` of
  ``orbax.checkpoint.experimental.v1``, the API Orbax documents now (``save_pytree`` and
  ``save_pytree_async`` are deprecated aliases of them in orbax-checkpoint 0.12.8). The state
  is the torch state converted once to jax arrays on the CPU device (same dtypes, copied into
  XLA-owned buffers, untimed); both need ``jax`` and ``orbax-checkpoint`` (the ``bench`` extra)
  and are recorded as skipped without them.

DCP needs a process group even for one process: a gloo group of world size 1 is initialised
in-process from a ``FileStore`` (no TCP port to collide with other users of the machine).
DCP writes fsync their files (``FileSystemWriter(sync_files=True)`` is the default).

Run alone: ``python -m benchmarks.peers --system torch_save --size 256M --dir /tmp/zsb``.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import measure
from benchmarks.floors import child_args
from benchmarks.state import (
    build_state,
    flat_dict,
    iter_tensors,
    map_tensors,
    parse_size,
)

ALL = ["torch_save", "safetensors", "dcp_save", "dcp_async", "dcp_async_stager",
       "dcp_async_cached", "dcp_async_process", "orbax_save", "orbax_async"]
#: Peers measured by default; ``dcp_async_process`` is opt-in because on two cores it only adds
#: a second copy of the state and a process start (see peer-numbers.md) at a large time cost.
DEFAULT = ["torch_save", "safetensors", "dcp_save", "dcp_async", "dcp_async_stager",
           "dcp_async_cached", "orbax_save", "orbax_async"]


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    measure.fsync_dir(path.parent)


def _copy_into(template: Any, loaded: Any) -> Any:
    """Copy a freshly loaded tree into the template, as ``load_state_dict`` would."""
    for (_, dst), (_, src) in zip(iter_tensors(template), iter_tensors(loaded)):
        dst.copy_(src)
    return template


class TorchSave(measure.System):
    name = "torch_save"
    in_place = True  # via torch.load + copy_

    def save(self, path: Path, state: Any) -> measure.Pending:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        measure.fsync_dir(path.parent)
        return measure.Done()

    def restore(self, path: Path, template: Any) -> Any:
        return _copy_into(template, torch.load(path, map_location="cpu", weights_only=True))


class Safetensors(measure.System):
    """safetensors stores a flat dotted-name -> tensor map."""

    name = "safetensors"
    in_place = True  # via load_file + copy_

    def setup(self, directory: Path) -> None:
        import safetensors.torch as st

        self.st = st

    def save(self, path: Path, state: Any) -> measure.Pending:
        self.st.save_file(flat_dict(state), str(path))
        _fsync_file(path)
        return measure.Done()

    def restore(self, path: Path, template: Any) -> Any:
        flat = self.st.load_file(str(path))
        for key, dst in iter_tensors(template):
            dst.copy_(flat[key])
        return template


_PG_READY = False


def init_process_group() -> None:
    """gloo, world size 1, rank 0, rendezvous through a FileStore in a temp dir."""
    global _PG_READY
    import torch.distributed as dist

    if _PG_READY or dist.is_initialized():
        _PG_READY = True
        return
    store_file = tempfile.NamedTemporaryFile(prefix="zsb-pg-", delete=False).name
    os.unlink(store_file)  # FileStore creates it
    dist.init_process_group("gloo", store=dist.FileStore(store_file, 1), rank=0, world_size=1)
    _PG_READY = True


class _FuturePending(measure.Pending):
    def __init__(self, fut: Any, extra: dict[str, Any] | None = None) -> None:
        self.fut, self.extra = fut, extra

    def wait(self) -> dict[str, Any] | None:
        self.fut.result()
        return self.extra


class DcpSave(measure.System):
    name = "dcp_save"
    in_place = True

    def setup(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        init_process_group()
        self.dcp = dcp

    def save(self, path: Path, state: Any) -> measure.Pending:
        self.dcp.save(state, checkpoint_id=str(path))
        return measure.Done()

    def restore(self, path: Path, template: Any) -> Any:
        self.dcp.load(template, checkpoint_id=str(path))
        return template


class DcpAsync(DcpSave):
    """Default ``async_save``: thread executor, an internal stager that allocates every save."""

    name = "dcp_async"

    def save(self, path: Path, state: Any) -> measure.Pending:
        fut = self.dcp.async_save(state, checkpoint_id=str(path))
        return _FuturePending(_upload_future(fut))


def _upload_future(resp: Any) -> Any:
    """``async_save`` returns a Future or an ``AsyncSaveResponse`` depending on the stager."""
    return getattr(resp, "upload_completion", resp)


class DcpAsyncStager(DcpSave):
    name = "dcp_async_stager"

    def setup(self, directory: Path) -> None:
        super().setup(directory)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=False,
            use_async_staging=True, use_non_blocking_copy=False))

    def save(self, path: Path, state: Any) -> measure.Pending:
        t0 = measure.now()
        resp = self.dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager)
        returned = measure.now() - t0
        staging = getattr(resp, "staging_completion", None)
        if staging is not None:
            staging.result()  # the caller may not mutate its tensors before this
        return _FuturePending(_upload_future(resp), {"call_returned_s": returned})

    def close(self) -> None:
        self.stager.close()


class DcpAsyncCached(DcpSave):
    name = "dcp_async_cached"

    def setup(self, directory: Path) -> None:
        super().setup(directory)
        from torch.distributed.checkpoint import FileSystemWriter

        self.writer_cls = FileSystemWriter

    def save(self, path: Path, state: Any) -> measure.Pending:
        writer = self.writer_cls(str(path), cache_staged_state_dict=True)
        fut = self.dcp.async_save(state, storage_writer=writer)
        return _FuturePending(_upload_future(fut))


class DcpAsyncProcess(DcpSave):
    name = "dcp_async_process"

    def save(self, path: Path, state: Any) -> measure.Pending:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        fut = self.dcp.async_save(state, checkpoint_id=str(path),
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        return _FuturePending(_upload_future(fut))


class OrbaxSave(measure.System):
    """Orbax v1 free functions on jax arrays; see the module docstring."""

    name = "orbax_save"
    in_place = False  # jax arrays are immutable: ``load`` returns new ones

    def setup(self, directory: Path) -> None:
        import jax
        import orbax.checkpoint.experimental.v1 as ocp

        self.jax, self.ocp = jax, ocp
        self.cpu = jax.devices("cpu")[0]
        # Options live in a Context that applies inside ``with``; an async save keeps the
        # Context it started under, so one shared, never mutated Context serves every call.
        self.ctx = ocp.Context()
        self.ctx.array.saving.use_compression = False

    def native(self, state: Any) -> Any:
        import jax.numpy as jnp

        # copy=True: device_put of a 64-byte aligned numpy array aliases it on CPU, and the
        # jax state should own its buffers as a jax trainer's does.
        return map_tensors(state, lambda t: self.jax.device_put(jnp.array(t.numpy(), copy=True), self.cpu))

    def template(self, state: Any) -> Any:
        sharding = self.jax.sharding.SingleDeviceSharding(self.cpu)
        return map_tensors(state, lambda t: self.jax.ShapeDtypeStruct(
            tuple(t.shape), t.numpy().dtype, sharding=sharding))

    def equal(self, state: Any, restored: Any) -> bool:
        import numpy as np

        # By key, not by order: a jax pytree orders dict keys sorted, the torch tree as inserted.
        want = dict(iter_tensors(state))
        got = dict(iter_tensors(restored, kind=self.jax.Array))
        return want.keys() == got.keys() and all(
            t.numpy().dtype == got[k].dtype and np.array_equal(t.numpy(), np.asarray(got[k]))
            for k, t in want.items())

    def save(self, path: Path, state: Any) -> measure.Pending:
        with self.ctx:
            self.ocp.save(path, state)
        measure.fsync_tree(path)
        return measure.Done()

    def restore(self, path: Path, template: Any) -> Any:
        with self.ctx:
            restored = self.ocp.load(path, template)
        return self.jax.block_until_ready(restored)


class _OrbaxPending(measure.Pending):
    def __init__(self, resp: Any, path: Path) -> None:
        self.resp, self.path = resp, path

    def wait(self) -> dict[str, Any] | None:
        self.resp.result()
        measure.fsync_tree(self.path)
        return None


class OrbaxAsync(OrbaxSave):
    name = "orbax_async"

    def save(self, path: Path, state: Any) -> measure.Pending:
        with self.ctx:
            return _OrbaxPending(self.ocp.save_async(path, state), path)


def orbax_missing() -> str | None:
    """None if the Orbax peers can run here, else why not (they are then recorded as skipped)."""
    try:
        import jax  # noqa: F401
        import orbax.checkpoint.experimental.v1  # noqa: F401
    except ImportError as e:
        return f"jax or orbax-checkpoint not importable ({e}); install the bench extra"
    return None


FACTORIES: dict[str, Callable[[], measure.System]] = {
    "torch_save": TorchSave, "safetensors": Safetensors, "dcp_save": DcpSave,
    "dcp_async": DcpAsync, "dcp_async_stager": DcpAsyncStager,
    "dcp_async_cached": DcpAsyncCached, "dcp_async_process": DcpAsyncProcess,
    "orbax_save": OrbaxSave, "orbax_async": OrbaxAsync,
}


def run(system_name: str, state_size: int, directory: Path, repeats: int) -> dict[str, Any]:
    """Measure one peer; an exception becomes ``{"error": ...}`` so the suite goes on."""
    why = orbax_missing() if system_name.startswith("orbax") else None
    if why:
        return {"system": system_name, "skipped": why}
    state = build_state(state_size)
    try:
        return measure.measure_system(FACTORIES[system_name](), state, directory, repeats)
    except Exception as e:  # a peer failing is a result to record, not a suite failure
        tb = traceback.format_exc(limit=-3)
        measure.log(f"{system_name} failed: {type(e).__name__}: {e}")
        return {"system": system_name, "error": f"{type(e).__name__}: {e}", "traceback": tb}


def main() -> None:
    p = child_args(__doc__.splitlines()[0])
    p.add_argument("--system", required=True, choices=ALL)
    args = p.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    measure.emit(run(args.system, parse_size(args.size), directory, args.repeats))


if __name__ == "__main__":
    main()
