"""Storage backends, chosen by URL scheme.

``/path`` or ``file:///path``: :class:`~zerostall.storage.local.LocalStorage`;
``memory://name``: :class:`~zerostall.storage.memory.MemoryStorage` (one process, for tests and
the RAM tier); ``s3://bucket/prefix``: :class:`~zerostall.storage.s3.S3Storage` (needs the
``s3`` extra: ``pip install 'zerostall[s3]'``); further schemes register with :func:`register_scheme`
or are declared as entry points of group ``zerostall.storage`` (:data:`ENTRY_POINT_GROUP`).

A scheme must open in every process that saves or loads, the writer process included (a fresh
interpreter that opens storage by URL). An entry point is found there as here. A scheme added
with :func:`register_scheme` travels with each save as the import reference of its factory
(:func:`scheme_reference`), which the writer imports (:func:`import_scheme`) before it opens
the root.
"""

from __future__ import annotations

import importlib
import posixpath
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from zerostall.errors import InvalidArgumentError, MissingDependencyError
from zerostall.storage.base import Capabilities, Storage

__all__ = ["Storage", "Capabilities", "open_storage", "split_url", "register_scheme", "local_path",
           "scheme_reference", "import_scheme", "ENTRY_POINT_GROUP"]

#: The entry-point group that declares storage backends: ``scheme = "module:factory"``.
ENTRY_POINT_GROUP = "zerostall.storage"

_Factory = Callable[[str], Storage]
_SCHEMES: dict[str, tuple[str, str, str]] = {
    # scheme: (module, factory attribute, extra to install)
    "file": ("zerostall.storage.local", "LocalStorage", ""),
    "memory": ("zerostall.storage.memory", "MemoryStorage", ""),
    "s3": ("zerostall.storage.s3", "S3Storage", "s3"),
}
_REGISTERED: dict[str, _Factory] = {}
#: scheme -> the import reference of its factory, ``module[:qualified name]`` ("" if it has none)
_REFERENCES: dict[str, str] = {}


def register_scheme(scheme: str, factory: _Factory) -> None:
    """Make ``scheme://`` URLs open with ``factory(root_url)``, here and in the writer process.

    The backend ``factory`` returns must declare its
    :attr:`~zerostall.storage.base.Storage.capabilities`. The writer process imports
    ``factory.__module__`` before a save to such a URL and takes ``factory`` from it by name
    (or the import registers the scheme itself): the module must be importable there (installed,
    or on ``PYTHONPATH``). A factory defined in the script being run (``__main__``) reaches only
    a thread writer; the process writer fails that save with a
    :class:`~zerostall.errors.MissingDependencyError` naming the scheme.
    """
    scheme = scheme.lower()
    _REGISTERED[scheme] = factory
    _REFERENCES[scheme] = _reference_of(factory)


def _reference_of(factory: object) -> str:
    module = getattr(factory, "__module__", None)
    if not isinstance(module, str):
        return ""
    if module == "__main__":  # run as ``python -m pkg.mod``: importable under its real name
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None and spec.name != "__main__" else module
    qualname = getattr(factory, "__qualname__", None)
    if isinstance(qualname, str) and "<" not in qualname:  # not a lambda or a function's local
        return f"{module}:{qualname}"
    return module


def scheme_reference(url: str) -> str:
    """The import reference of the factory that opens ``url`` when :func:`register_scheme` added its
    scheme (``module:qualified name``, or a module whose import registers it); "" otherwise."""
    return _REFERENCES.get(_scheme_of(str(url)), "")


def import_scheme(url: str, reference: str) -> None:
    """Make ``url``'s scheme open in this process by importing ``reference`` (:func:`scheme_reference`
    in the process that registered it); nothing to do for a scheme known here already.

    Raises:
        MissingDependencyError: the module cannot be imported here, or does not define the
            factory and does not register the scheme on import (the message names the scheme).
    """
    scheme = _scheme_of(str(url))
    if not reference or scheme in _REGISTERED or scheme in _SCHEMES:
        return
    module_name, _, qualname = reference.partition(":")
    where = f"the {scheme}:// storage backend was registered with register_scheme by module {module_name!r}"
    fix = (f"make {module_name!r} importable in the writer process (installed, or on PYTHONPATH), declare an "
           f"entry point in group {ENTRY_POINT_GROUP!r}, or save with WriterKind.THREAD")
    if module_name == "__main__":
        raise MissingDependencyError(f"{where} (the script being run), which a writer process cannot import; "
                                     f"{fix}", path=str(url), name=module_name)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise MissingDependencyError(f"{where}, which cannot be imported here: {type(exc).__name__}: {exc}; {fix}",
                                     path=str(url), name=module_name) from exc
    if scheme in _REGISTERED:
        return  # registered by the import itself
    factory: object = module
    for part in qualname.split(".") if qualname else ():
        factory = getattr(factory, part, None)
    if not qualname or not callable(factory):
        raise MissingDependencyError(f"{where}, and importing it here neither registers the scheme nor defines "
                                     f"{qualname or 'the factory'}; {fix}", path=str(url), name=module_name)
    register_scheme(scheme, factory)


def _from_entry_point(scheme: str, url: str) -> _Factory | None:
    """The factory an installed distribution declares for ``scheme`` (registered here); None if none does."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name.lower() != scheme:
            continue
        try:
            factory = ep.load()
        except Exception as exc:
            raise MissingDependencyError(f"the {scheme}:// storage backend declared by entry point {ep.value!r} "
                                         f"(group {ENTRY_POINT_GROUP!r}) cannot be loaded: {type(exc).__name__}: "
                                         f"{exc}", path=url, name=ep.value.partition(":")[0]) from exc
        register_scheme(scheme, factory)
        return factory  # type: ignore[no-any-return]
    return None


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
    """The backend rooted at ``root_url``.

    Raises:
        InvalidArgumentError: no backend for the URL's scheme, or one that declares no
            :class:`~zerostall.storage.base.Capabilities`.
        MissingDependencyError: the backend's module or an optional dependency cannot be imported.
    """
    scheme = _scheme_of(str(root_url))
    factory = _REGISTERED.get(scheme)
    if factory is None and scheme not in _SCHEMES:
        factory = _from_entry_point(scheme, str(root_url))
    if factory is not None:
        return _declared(factory(str(root_url)), scheme, str(root_url))
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
    builtin: _Factory = getattr(module, attr)
    return builtin(str(root_url))


def _declared(storage: Storage, scheme: str, url: str) -> Storage:
    """``storage``, once it is known to declare its capabilities (a backend from outside zerostall)."""
    try:
        declared: object = storage.capabilities
    except AttributeError:
        declared = None
    if not isinstance(declared, Capabilities):
        raise InvalidArgumentError(f"the {scheme}:// storage backend {type(storage).__qualname__} declares no "
                                   "capabilities: give its class a 'capabilities = Capabilities(...)' attribute "
                                   "(zerostall.storage.Capabilities(), all False, if it has no optional methods)",
                                   path=url, argument="path")
    return storage
