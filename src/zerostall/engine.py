"""The save engine: flatten → plan → stage into a free buffer slot → hand off to the writer.

``Engine.save_async`` is the whole of what a save costs the training thread. Everything after
the hand-off (I/O, checksums, manifest, commit, retention) runs in the writer.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

from zerostall.commit import exists_error
from zerostall.errors import WriterError
from zerostall.options import SaveOptions
from zerostall.persist.client import WriterClient
from zerostall.response import Response
from zerostall.stage import BufferPool, Plan, make_plan, stage
from zerostall.stage.stager import prepare_slot
from zerostall.storage import open_storage
from zerostall.tree import flatten

__all__ = ["Engine"]

log = logging.getLogger("zerostall")
_PLAN_CACHE = 8
_STORAGE_ENV = ("AWS_", "ZEROSTALL_S3_")


def _cuda_present() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


class Engine:
    """Owns the staging buffers, the plan cache and one writer; not shared across processes."""

    def __init__(self, options: SaveOptions | None = None, *, prewarm: bool = False) -> None:
        self.options = options or SaveOptions()
        self.writer = WriterClient(self.options.writer, nice=self.options.writer_nice)
        self.pool = BufferPool(self.options.max_in_flight, pin=_cuda_present(), on_free=self.writer.forget)
        self._plans: OrderedDict[tuple[object, ...], tuple[Plan, list[dict[str, Any]]]] = OrderedDict()
        self._inflight: set[Response] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._dist: Any = None  # a zerostall.dist.context.DistContext once a collective save ran
        if prewarm:
            self.writer.start()

    def _plan(self, flat: Any) -> tuple[Plan, list[dict[str, Any]]]:
        with self._lock:
            return self._plan_locked(flat)

    def _plan_locked(self, flat: Any) -> tuple[Plan, list[dict[str, Any]]]:
        sig = flat.signature
        hit = self._plans.get(sig)
        if hit is not None:
            self._plans.move_to_end(sig)
            return hit
        plan = make_plan(flat, rank=self._dist.rank if self._dist is not None else 0)
        leaves = [
            {"key": leaf.key, "kind": leaf.kind, "dtype": leaf.dtype, "shape": list(leaf.shape),
             "file": fi, "offset": place.offset, "nbytes": leaf.nbytes}
            for leaf, place, fi in zip(flat.leaves, plan.slots, plan.leaf_file)
        ]
        self._plans[sig] = (plan, leaves)
        if len(self._plans) > _PLAN_CACHE:
            self._plans.popitem(last=False)
        return plan, leaves

    def prepare(self, items: dict[str, Any]) -> int:
        """Plan ``items``' layout and allocate (and pre-fault) every slot's buffers for it now.

        Returns the bytes allocated. Saves of the same layout then only copy. Nothing is saved.
        """
        flat = flatten(items)
        plan, _ = self._plan(flat)
        total = 0
        slots = [self.pool.acquire() for _ in range(self.options.max_in_flight)]
        try:
            for slot in slots:
                self.pool.fit(slot, [f.alloc for f in plan.files])
                prepare_slot(flat, plan, slot)
                total += slot.nbytes
        finally:
            for slot in slots:
                self.pool.release(slot)
        self.writer.start()
        return total

    def save_async(
        self,
        root_url: str,
        name: str,
        items: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        retention: dict[str, Any] | None = None,
    ) -> Response:
        t0 = time.perf_counter()
        if self._closed:
            raise WriterError("this saver is closed")
        path = f"{root_url.rstrip('/')}/{name}"
        dist_info = self._begin_collective(root_url, name)
        try:
            return self._save_async(root_url, name, path, items, t0, dist_info, metadata, retention)
        except BaseException as exc:
            if dist_info is not None:  # the other ranks' writers learn of it now, not at their timeout
                self._dist.abort(root_url, name, dist_info, path, exc)
            raise

    def _save_async(self, root_url: str, name: str, path: str, items: dict[str, Any], t0: float,
                    dist_info: dict[str, Any] | None, metadata: dict[str, Any] | None,
                    retention: dict[str, Any] | None) -> Response:
        storage = open_storage(root_url)
        if storage.atomic_rename and storage.exists(name):  # a cheap local check; the writer re-checks
            raise exists_error(storage, name, path)
        flat = flatten(items)
        plan, leaves = self._plan(flat)
        slot = self.pool.acquire()
        try:
            self.pool.fit(slot, [f.alloc for f in plan.files])
            t_copy = time.perf_counter()
            stage(flat, plan, slot)
            copy_s = time.perf_counter() - t_copy
        except BaseException:
            self.pool.release(slot)
            raise
        job = {
            "root": root_url,
            "name": name,
            "path": path,
            "files": [{"name": f.name, "length": f.size} for f in plan.files],
            "leaves": leaves,
            "items": flat.items,
            "metadata": metadata or {},
            "retention": retention,
            # The writer may have started before the caller set its storage credentials.
            "env": {k: v for k, v in os.environ.items() if k.startswith(_STORAGE_ENV)},
            "options": {"direct_io": self.options.direct_io, "io_threads": self.options.io_threads,
                        "chunk_bytes": self.options.chunk_bytes},
        }
        response = Response(path, sum(f.size for f in plan.files),
                            plan.nbytes / copy_s / 1e9 if copy_s > 0 else 0.0)
        on_done = response._finish
        if dist_info is not None:
            from zerostall.dist.dtensor import unhashed_leaves

            job["dist"] = dict(dist_info, unhashed=unhashed_leaves(flat.items))
            on_done = self._dist.on_done(root_url, name, dist_info, path, response._finish)
        with self._lock:
            self._inflight.add(response)
        response._add_before_done(self._on_done)
        try:
            self.writer.submit(job, slot.buffers, on_released=lambda: self.pool.release(slot),
                               on_done=on_done)
        except BaseException as exc:
            self.pool.release(slot)
            on_done(None, exc)
            raise
        response._stall_s = time.perf_counter() - t0  # the hand-off counts as stall too
        return response

    def _begin_collective(self, root_url: str, name: str) -> dict[str, Any] | None:
        """Under torch.distributed: number this save (and, the first time, agree on a run id)."""
        from zerostall.dist.context import DistContext, active

        if not active(self.options.distributed):
            return None
        if self._dist is None:
            self._dist = DistContext(self.options.distributed)
            self._plans.clear()  # plans name the rank's file
        info: dict[str, Any] = self._dist.begin_save(root_url, name)
        return info

    def _on_done(self, response: Response, exc: BaseException | None) -> None:
        with self._lock:
            self._inflight.discard(response)
        if exc is None:
            log.info("zerostall: saved %s", response.stats.summary())
            problem = (response._writer or {}).get("retention_error")
            if problem:
                log.warning("zerostall: %s committed, but deleting old steps failed (retried after the next "
                            "save): %s", response.stats.path, problem)
        else:
            log.warning("zerostall: save of %s failed: %s", response.stats.path, exc)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every in-flight save; errors stay with their responses."""
        with self._lock:
            pending = list(self._inflight)
        for r in pending:
            try:
                r.result(timeout)
            except Exception:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self.wait()
        self._closed = True
        self.writer.close()
        self.pool.close()
