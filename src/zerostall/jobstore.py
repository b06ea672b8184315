"""The job's ``torch.distributed`` store, with every call bounded in time.

torch's ``TCPStore`` client does not bound its requests against a server that stops answering:
with the server's host cut off (a failed link, a switch port) or its process stopped, ``add``,
``get`` and ``wait`` block until TCP itself gives up, about a quarter of an hour later, whatever
the client's ``timeout`` (``set`` returns: it waits for no answer). Every zerostall wait on the
store (the keepers' replica offers and group formation, a load's share exchange, the preemption
notice's agreement) goes through :func:`bounded`, so it ends within its bound and raises
:class:`~zerostall.errors.PeerUnreachableError`.

How: each request runs on a thread of its own while the caller waits for it with a deadline.
A request that misses it leaves its thread blocked inside the client, so the client is dropped
(its connection may still carry that request's answer) and the next request connects anew,
itself bounded; the abandoned thread is a daemon and ends when TCP does. The store returned is a
``torch.distributed.Store``, so ``PrefixStore`` and ``ProcessGroupGloo`` take it and their
rendezvous requests, made from C++, are bounded the same way.

Imports nothing of zerostall but its errors; torch is imported at the first :func:`bounded`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from zerostall.errors import PeerUnreachableError

__all__ = ["bounded", "deadline_of", "SLACK_S"]

#: how much longer than its own timeout a ``wait`` may take before the store is taken for
#: unreachable (a live server answers a timed-out wait at its timeout)
SLACK_S = 2.0

_class: type | None = None
_class_lock = threading.Lock()


def bounded(connect: Callable[[], Any], timeout_s: float, *, what: str = "the job's store", prefix: str = "") -> Any:
    """A ``torch.distributed.Store`` whose every request ends within ``timeout_s`` (a ``wait``
    within its own timeout plus :data:`SLACK_S`; a ``get``, which waits for its key up to
    ``timeout_s``, within that plus :data:`SLACK_S`), or raises
    :class:`PeerUnreachableError` naming ``what``. ``connect()`` makes a client of the store
    (``TCPStore(..., is_master=False)``, or ``store.clone()``); it is called lazily, again after
    a request that missed its bound, and bounded too. ``prefix``: prepended to every key, as
    ``PrefixStore`` does (``prefix/key``).

    A deadline set on the returned store (``store.deadline = time.monotonic() + s``; None: none)
    bounds every request further, for an operation of several requests that must end as one.
    """
    return _store_class()(connect, float(timeout_s), what, prefix)


def deadline_of(store: Any) -> float | None:
    """The deadline set on a store :func:`bounded` made (None: none, or not such a store)."""
    return getattr(store, "deadline", None)


def _store_class() -> type:
    global _class
    with _class_lock:
        if _class is None:
            _class = _make_class()
        return _class


def _make_class() -> type:
    import torch.distributed

    dist: Any = torch.distributed  # its store classes are not in its stubs' exports
    base: Any = dist.Store

    class BoundedStore(base):  # type: ignore[misc]
        def __init__(self, connect: Callable[[], Any], timeout_s: float, what: str, prefix: str) -> None:
            super().__init__()
            self._connect, self._timeout_s, self._what = connect, timeout_s, what
            self._prefix = f"{prefix}/" if prefix else ""
            self._lock = threading.Lock()
            self._client: Any = None
            self.deadline: float | None = None

        def _bound(self, wait_s: float | None) -> float:
            """How long a request may take: ``timeout_s`` (within the deadline), or for one that
            waits ``wait_s`` on the server (a wait, whose own timeout the caller already cut to
            the deadline; a get), that plus :data:`SLACK_S`, so that a live server's own
            timeout is what ends it."""
            if wait_s is not None:
                return wait_s + SLACK_S
            bound = self._timeout_s
            if self.deadline is not None:
                bound = min(bound, max(0.0, self.deadline - time.monotonic()))
            return bound

        def _run(self, op: str, fn: Callable[[Any], Any], wait_s: float | None = None) -> Any:
            bound = self._bound(wait_s)
            if bound <= 0:
                raise PeerUnreachableError(f"{self._what}: the time for this operation ran out before its {op}")
            box: dict[str, Any] = {}
            done = threading.Event()

            def call() -> None:
                try:
                    client = self._client
                    if client is None:
                        client = self._connect()
                        with self._lock:
                            if self._client is None:
                                self._client = client
                    box["value"] = fn(client)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    box["error"] = exc
                finally:
                    done.set()

            threading.Thread(target=call, name="zerostall-store", daemon=True).start()
            if not done.wait(bound):
                with self._lock:
                    self._client = None  # its connection may still carry this request's answer
                raise PeerUnreachableError(f"{self._what} did not answer its {op} request within {bound:.3g} s: "
                                           "its host is cut off, or its process hung")
            if "error" in box:
                raise box["error"]
            return box.get("value")

        # -- the Store interface (torch.distributed.Store; PrefixStore and gloo call these) ----

        def _k(self, key: str) -> str:
            return self._prefix + key

        def set(self, key: str, value: Any) -> None:
            self._run("set", lambda c: c.set(self._k(key), value))

        def get(self, key: str) -> Any:
            return self._run("get", lambda c: c.get(self._k(key)), self._timeout_s)

        def add(self, key: str, amount: int) -> int:
            return int(self._run("add", lambda c: c.add(self._k(key), amount)))

        def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
            return self._run("compare_set", lambda c: c.compare_set(self._k(key), expected, desired))

        def check(self, keys: list[str]) -> bool:
            return bool(self._run("check", lambda c: c.check([self._k(k) for k in keys])))

        def delete_key(self, key: str) -> bool:
            return bool(self._run("delete_key", lambda c: c.delete_key(self._k(key))))

        def num_keys(self) -> int:
            return int(self._run("num_keys", lambda c: c.num_keys()))

        def multi_get(self, keys: list[str]) -> list[Any]:
            return list(self._run("multi_get", lambda c: c.multi_get([self._k(k) for k in keys]), self._timeout_s))

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            self._run("multi_set", lambda c: c.multi_set([self._k(k) for k in keys], values))

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            wait_s = self._timeout_s if timeout is None else timeout.total_seconds()
            if self.deadline is not None:
                wait_s = min(wait_s, self.deadline - time.monotonic())
            if wait_s <= 0:  # (and a zero timeout would mean none to the client)
                raise PeerUnreachableError(f"{self._what}: the time for this operation ran out before its wait")
            self._run("wait", lambda c: c.wait([self._k(k) for k in keys], timedelta(seconds=wait_s)), wait_s)

        def set_timeout(self, timeout: timedelta) -> None:
            self._timeout_s = timeout.total_seconds()

        def clone(self) -> Any:
            return type(self)(self._connect, self._timeout_s, self._what, self._prefix.rstrip("/"))

    return BoundedStore
