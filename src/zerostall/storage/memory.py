"""In-memory backend (``memory://name``): one dictionary per name, shared inside one process.

It has an atomic rename, so the same commit protocol as POSIX applies. It lives in the process
that writes, so use it with ``WriterKind.THREAD``.
"""

from __future__ import annotations

import errno
import threading

from zerostall.storage.base import Capabilities

__all__ = ["MemoryStorage"]

_STORES: dict[str, dict[str, bytes]] = {}
_LOCK = threading.Lock()


class MemoryStorage:
    atomic_rename = True
    capabilities = Capabilities(probe=True)

    def __init__(self, root_url: str) -> None:
        self.url = root_url.rstrip("/")
        name = self.url.split("://", 1)[1]
        bucket, _, prefix = name.partition("/")
        self._prefix = f"{prefix}/" if prefix else ""
        with _LOCK:
            self._objects = _STORES.setdefault(bucket, {})

    def _k(self, key: str) -> str:
        # Same key rules as every backend, though there is no filesystem to escape here.
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"storage key {key!r} leaves the root {self.url!r}")
        return self._prefix + key

    def write_from_buffer(
        self, key: str, buf: memoryview, length: int, *, threads: int, chunk_bytes: int, direct: bool
    ) -> None:
        self.put(key, bytes(buf[:length]), if_absent=True)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        k = self._k(key)
        with _LOCK:
            if if_absent and k in self._objects:
                raise FileExistsError(errno.EEXIST, "object exists", k)
            self._objects[k] = bytes(data)

    def get(self, key: str) -> bytes:
        with _LOCK:
            try:
                return self._objects[self._k(key)]
            except KeyError:
                raise FileNotFoundError(errno.ENOENT, "no such object", key) from None

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        data = self.get(key)
        if offset + len(buf) > len(data):
            raise EOFError(f"{key}: object ends before byte {offset + len(buf)}")
        buf[:] = data[offset:offset + len(buf)]

    def size(self, key: str) -> int:
        return len(self.get(key))

    def exists(self, key: str) -> bool:
        k = self._k(key)
        with _LOCK:
            return k in self._objects or any(o.startswith(k + "/") for o in self._objects)

    def list(self, prefix: str) -> list[str]:
        base = self._k(prefix)
        base = base + "/" if base and not base.endswith("/") else base
        with _LOCK:
            names = {o[len(base):].split("/", 1)[0] for o in self._objects if o.startswith(base)}
        return sorted(n for n in names if n)

    def delete(self, prefix: str) -> None:
        k = self._k(prefix)
        with _LOCK:
            for o in [o for o in self._objects if o == k or o.startswith(k + "/")]:
                del self._objects[o]

    def rename(self, src: str, dst: str) -> None:
        s, d = self._k(src), self._k(dst)
        with _LOCK:
            if any(o == d or o.startswith(d + "/") for o in self._objects):
                raise FileExistsError(errno.EEXIST, "target exists", dst)
            for o in [o for o in self._objects if o == s or o.startswith(s + "/")]:
                self._objects[d + o[len(s):]] = self._objects.pop(o)

    def sync(self, prefix: str) -> None:
        return None

    def probe(self, *, write: bool) -> None:
        return None  # always reachable: it lives in this process
