"""Map an adopted keeper's step once, in the background, before the restarted trainer loads it.

A restarted trainer adopts its keeper when it opens its ``Checkpointer``; its first load reads the
step the keeper holds from shared memory. Mapping those memfds afresh costs the first reader the
page-table work of every 4 KiB page (about 0.11 s of CPU per GiB here) on top of the copy: that
made the first load after a restart 1.2-1.6x a memcpy (docs/performance.md). So right after the
adoption a daemon thread asks the keeper for its step (the query waits for the keeper's check
after the crash), maps it (:func:`zerostall.memtier.image.open_image`) and pre-faults it
(:meth:`~zerostall.memtier.image.ImageStorage.populate`), while the user's code imports and
builds its model. A load of that step then copies out of this mapping instead of mapping again.
A load that takes the mapping while the pre-fault still runs stops it and faults the rest on its
own copy threads: waiting would serialise the rest on one thread, and racing it (measured, 2
cores, 4 GiB: 1.56 s against 1.29 s for a fresh mapping) was slower than either.

The mapping is released when a save is submitted (the keeper then lets go of the step, and a
mapping here would keep its memory alive), when the ``Checkpointer`` closes, and on any
failure of the background work (a load then maps the step itself, as without this). A load
on another thread that is copying out of the mapping at that moment keeps it: the mapping is
released when that load ends (:meth:`Premap.done`), never under it.
"""

from __future__ import annotations

import logging
import os
import threading

from zerostall.memtier.client import KeeperSide
from zerostall.memtier.image import ImageStorage, open_image
from zerostall.memtier.messages import Image
from zerostall.persist import faults

__all__ = ["Premap"]

log = logging.getLogger("zerostall")


class Premap:
    """The adopted keeper's step, mapped and pre-faulted by a background thread.

    Example::

        premap = Premap(writer)          # right after the writer adopted a keeper
        image = premap.take(img, fds)    # in a load: the mapping, if it is of these memfds
        premap.close()                   # a save, or the Checkpointer's close
    """

    def __init__(self, writer: KeeperSide) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._closed = False
        self._image: ImageStorage | None = None
        self._manifest: str | None = None
        #: set once the thread has mapped the step (or given up): a load waits for this only
        self._mapped = threading.Event()
        self._pid = os.getpid()  # a forked child has no mapping (memtier.image: MADV_DONTFORK)
        self._last: ImageStorage | None = None  # kept for :attr:`populated` after close()
        #: how many loads used this mapping instead of mapping the step again
        self.reused = 0
        #: loads copying out of the mapping now (:meth:`take` to :meth:`done`), and the mapping
        #: a close() left for the last of them to unmap
        self._users = 0
        self._doomed: ImageStorage | None = None
        self._thread = threading.Thread(target=self._run, name="zerostall-premap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            got = None if self._closed else self._writer.query_image(start=False)
            if got is None:
                return
            img, fds = got
            if img.step is None or not img.files:
                for fd in fds:
                    os.close(fd)
                return
            image = open_image(img.name, img.manifest.encode(),
                               [(f.name, f.length, f.size, fd) for f, fd in zip(img.files, fds, strict=True)])
            with self._lock:
                if self._closed:  # a save or close came first: the step may be let go of already
                    image.close()
                    return
                self._image, self._manifest, self._last = image, img.manifest, image
            self._mapped.set()
            faults.hit("premap_populate")
            image.populate()
        except Exception as exc:  # noqa: BLE001 - an optimisation: the load maps the step itself
            log.debug("zerostall: pre-mapping the memory tier's step failed: %r", exc)
        finally:
            self._mapped.set()

    @property
    def populated(self) -> int:
        """Bytes of the step pre-faulted so far (for tests and benchmarks)."""
        return self._last.populated if self._last is not None else 0

    def take(self, img: Image, fds: list[int]) -> ImageStorage | None:
        """The mapping of ``img`` if this holds it (``fds`` are then closed), else None (``fds``
        untouched). Waits for the thread to have mapped the step; stops its pre-fault if that
        still runs (the load's copy threads fault what is left). A load that got the mapping
        calls :meth:`done` when it has finished copying from it."""
        if self._closed or os.getpid() != self._pid:
            return None
        # The thread's query came first (the writer serialises queries) and its mapping is a
        # few system calls away: waiting is shorter than mapping again.
        self._mapped.wait()
        with self._lock:
            image = self._image
            if (image is None or self._closed or img.manifest != self._manifest
                    or _identity(fds) != image.identity):
                return None
            self.reused += 1
            self._users += 1
        image.stop_populating()
        for fd in fds:
            os.close(fd)
        return image

    def close(self) -> None:
        """Unmap (stopping a pre-fault that still runs); a load using the mapping must have ended."""
        if os.getpid() != self._pid:  # a forked child: nothing mapped here, and the lock may be held
            self._closed, self._image = True, None
            return
        with self._lock:
            self._closed = True
            image, self._image = self._image, None
            if image is not None and self._users:
                # A load on another thread copies from it (a save on this one): unmapping now would
                # pull the views out from under it. The last such load's done() unmaps it.
                self._doomed, image = image, None
        if image is not None:
            try:
                image.close()
            except BufferError:  # a load on another thread still copies from it: unmapped when it lets go
                log.debug("zerostall: the pre-mapped step is still in use; unmapped when the load ends")

    def done(self, image: ImageStorage) -> None:
        """A load that :meth:`take` gave ``image`` has finished with it: unmap it now if a
        :meth:`close` came meanwhile and this was the last load using it."""
        with self._lock:
            self._users -= 1
            last = self._users == 0 and self._doomed is image
            if last:
                self._doomed = None
        if last:
            image.close()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the background thread to end (the pre-fault done or stopped); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _identity(fds: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple((st.st_dev, st.st_ino) for st in (os.fstat(fd) for fd in fds))
