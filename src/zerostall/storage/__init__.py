"""Storage backends, chosen by URL scheme.

``/path`` or ``file:///path``: :class:`~zerostall.storage.local.LocalStorage`;
``memory://name``: :class:`~zerostall.storage.memory.MemoryStorage` (one process, for tests and
the RAM tier); ``s3://bucket/prefix``: :class:`~zerostall.storage.s3.S3Storage` (needs the
``s3`` extra: ``pip install 'zerostall[s3]'``); further schemes register with :func:`register_scheme`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable

from zerostall.errors import InvalidArgumentError, MissingDependencyError
from zerostall.storage.base import Storage

__all__ = ["Storage", "open_storage", "split_url", "register_scheme", "local_path"]

_Factory = Callable[[str], Storage]
_SCHEMES: dict[str, tuple[str, str, str]] = {
    # scheme: (module, factory attribute, extra to install)
    "file": ("zerostall.storage.local", "LocalStorage", ""),
    "memory": ("zerostall.storage.memory", "MemoryStorage", ""),
    "s3": ("zerostall.storage.s3", "S3Storage", "s3"),
}
_REGISTERED: dict[str, _Factory] = {}


def register_scheme(scheme: str, factory: _Factory) -> None:
    """Make ``scheme://`` URLs open with ``factory(root_url)``."""
    _REGISTERED[scheme] = factory


def _scheme_of(url: str) -> str:
    head, sep, _ = url.partition("://")
    return head.lower() if sep else "file"


def local_path(url: str) -> str | None:
    """The absolute local path of a ``/path`` or ``file://`` URL (``~`` expanded); None for other schemes.

    Example::

        >>> local_path("file:///tmp/run") == "/tmp/run", local_path("s3://bucket/run") is None
        (True, True)
    """
    url = str(url)
    if _scheme_of(url) != "file":
        return None
    path = url.removeprefix("file://")
    if url.startswith("file://") and not path.startswith("/"):
        # file://tmp/run named a directory "tmp/run" under the working directory, silently
        host, _, rest = path.partition("/")
        if host != "localhost":
            raise InvalidArgumentError(f"a file:// URL takes an absolute path after its two slashes "
                                       f"(file:///{path}, three slashes, or a plain path); {url!r} names host "
                                       f"{host!r}", path=url)
        path = "/" + rest
    return posixpath.normpath(posixpath.abspath(posixpath.expanduser(path)))


def split_url(url: str) -> tuple[str, str]:
    """Split a checkpoint URL into the URL of its parent and its last path component."""
    url = str(url)
    scheme = _scheme_of(url)
    path = local_path(url)
    if path is not None:
        parent, name = posixpath.split(path)
        return parent, name
    rest = url.split("://", 1)[1].rstrip("/")
    parent, _, name = rest.rpartition("/")
    if not parent or not name:  # "s3://bucket" or "memory://x": a checkpoint needs a place to live in
        raise InvalidArgumentError(f"a {scheme}:// checkpoint path needs a root and a name ({scheme}://root/name)",
                                   path=url, argument="path")
    return f"{scheme}://{parent}", name


def open_storage(root_url: str) -> Storage:
    """The backend rooted at ``root_url``."""
    scheme = _scheme_of(str(root_url))
    if scheme in _REGISTERED:
        return _REGISTERED[scheme](str(root_url))
    if scheme not in _SCHEMES:
        raise InvalidArgumentError(f"no storage backend for URL scheme {scheme!r}; known: "
                                   f"{sorted(set(_SCHEMES) | set(_REGISTERED))}", path=str(root_url), argument="path")
    module_name, attr, extra = _SCHEMES[scheme]
    try:
        module = __import__(module_name, fromlist=[attr])
    except ImportError as exc:  # an optional dependency is missing
        hint = f": pip install 'zerostall[{extra}]'" if extra else ""
        missing = exc.name or module_name
        raise MissingDependencyError(f"the {scheme}:// backend needs {missing!r}, which is not installed{hint}",
                                     path=str(root_url), name=missing) from exc
    factory: _Factory = getattr(module, attr)
    return factory(str(root_url))
