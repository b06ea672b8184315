"""Argument checks shared by the public API: each failure is a typed error naming the argument.

Every check runs on the caller's thread before any work starts, so a bad argument is raised
where it was passed (never later, by the writer). Wrong types raise
:class:`~zerostall.errors.ArgumentTypeError` (a ``TypeError`` and a ``ValueError``), values out
of range :class:`~zerostall.errors.InvalidArgumentError` (a ``ValueError``).

``metadata=`` is checked and normalized by :func:`clean_metadata` (see its docstring and
docs/guarantees.md, "Metadata").
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from zerostall.errors import ArgumentTypeError, InvalidArgumentError, MetadataError, MetadataTypeError

__all__ = [
    "check_int", "check_optional_int", "check_number", "check_bool", "check_choice", "check_step", "check_path",
    "check_callable", "check_instance", "check_items", "clean_metadata", "MAX_METADATA_DEPTH",
]

#: deeper ``metadata=`` nesting is refused (also what stops a self-referencing dict)
MAX_METADATA_DEPTH = 64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, *, lo: int | None = None, path: str | None = None,
              or_none: bool = False) -> int:
    """``value`` as an int of at least ``lo``; a bool, float or str is a type error.

    >>> check_int("io_threads", 4, lo=1)
    4
    """
    want = ("a positive int" if lo == 1 else f"an int >= {lo}" if lo is not None else "an int") + \
        (" or None" if or_none else "")
    if not _is_int(value):
        raise ArgumentTypeError(f"{name} must be {want}, got {_short(value)}", argument=name, path=path)
    assert isinstance(value, int)
    if lo is not None and value < lo:
        raise InvalidArgumentError(f"{name} must be {want}, got {value}", argument=name, path=path)
    return value


def check_optional_int(name: str, value: object, *, lo: int | None = None, path: str | None = None) -> int | None:
    """As :func:`check_int`, or None."""
    return None if value is None else check_int(name, value, lo=lo, path=path, or_none=True)


def check_number(name: str, value: object, *, positive: bool = False, path: str | None = None) -> float:
    """A finite real number (int or float, not bool); ``positive``: also > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number, got {_short(value)}", argument=name, path=path)
    if not math.isfinite(value) or (positive and not value > 0):
        raise InvalidArgumentError(f"{name} must be {'> 0 and ' if positive else ''}finite, got {value!r}",
                                   argument=name, path=path)
    return float(value)


def check_timeout(name: str, value: object, *, path: str | None = None) -> float | None:
    """A wait's limit: None (no limit) or a finite number of seconds >= 0 (0 polls)."""
    if value is None:
        return None
    seconds = check_number(name, value, path=path)
    if seconds < 0:
        raise InvalidArgumentError(f"{name} must be >= 0 seconds or None, got {value!r}", argument=name, path=path)
    return seconds


def check_bool(name: str, value: object, *, path: str | None = None) -> bool:
    """A real bool: ``1`` or ``"yes"`` is refused rather than guessed."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {_short(value)}", argument=name, path=path)
    return value


def check_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    """``value`` is one of ``choices``."""
    if not any(value == c and type(value) is type(c) for c in choices):
        raise InvalidArgumentError(f"{name} must be one of {', '.join(map(repr, choices))}, got {_short(value)}",
                                   argument=name)


def check_instance(name: str, value: object, cls: type | tuple[type, ...], *, optional: bool = True) -> None:
    """``value`` is an instance of ``cls`` (or None when ``optional``)."""
    if (value is None and optional) or isinstance(value, cls):
        return
    want = cls.__name__ if isinstance(cls, type) else " or ".join(c.__name__ for c in cls)
    raise ArgumentTypeError(f"{name} must be a {want}{' or None' if optional else ''}, got {_short(value)}",
                            argument=name)


def check_callable(name: str, value: object) -> None:
    """A callable or None."""
    if value is not None and not callable(value):
        raise ArgumentTypeError(f"{name} must be callable or None, got {_short(value)}", argument=name)


def check_step(value: object, *, path: str | None = None, name: str = "step") -> int:
    """A step number: a non-negative int (numpy integers accepted), never a bool or float.

    >>> check_step(10)
    10
    """
    if not _is_int(value) and type(value).__module__ == "numpy" and hasattr(value, "dtype") \
            and getattr(value.dtype, "kind", "") in ("i", "u") and getattr(value, "ndim", 1) == 0:
        value = int(value)  # type: ignore[call-overload]  # a numpy integer scalar
    if not _is_int(value):
        raise ArgumentTypeError(f"{name} must be a non-negative int, got {_short(value)}", argument=name, path=path)
    assert isinstance(value, int)
    if value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value}", argument=name, path=path)
    return value


def check_path(value: object, name: str = "path") -> str:
    """A ``str`` or ``os.PathLike`` path or URL, as a str; an empty one is refused.

    ``~`` is expanded later, where the path is resolved (``zerostall.storage.local_path``), for
    every local path zerostall takes.
    """
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{name} must be a str or os.PathLike, got {_short(value)}", argument=name)
    text = os.fspath(value)
    if not isinstance(text, str):
        raise ArgumentTypeError(f"{name} must be a str path, got bytes {text!r}", argument=name)
    if not text.strip():
        raise InvalidArgumentError(f"{name} must not be empty", argument=name)
    if "\x00" in text:
        raise InvalidArgumentError(f"{name} must not contain a NUL character", argument=name, path=text)
    return text


def check_items(items: object, path: str | None = None) -> None:
    """``items=`` of the ``*_checkpointables`` functions: a dict of non-empty ``str`` names without ``/``."""
    if not isinstance(items, dict):
        raise ArgumentTypeError(f"items must be a dict of name -> item, got {_short(items)}", argument="items",
                                path=path)
    for name in items:
        if not isinstance(name, str) or not name or "/" in name:
            raise InvalidArgumentError(f"item names must be non-empty str without '/', got {_short(name)}",
                                       argument="items", path=path)


def clean_metadata(metadata: object, *, reserved: tuple[str, ...] = (), path: str | None = None) -> dict[str, Any]:
    """Check ``metadata=`` and return a JSON-ready copy, or raise naming the offending key.

    Accepted: ``None`` (empty), and a dict with ``str`` keys whose values are None, bool, int,
    finite float, str, list/tuple (stored as a list) or such a dict, nested up to 64 levels.
    NumPy scalars and 0-d arrays become the Python value (``np.float32(0.5)`` -> ``0.5``).

    Refused: NaN and infinities (:class:`~zerostall.errors.MetadataError`: manifests are strict
    JSON; store ``str(x)`` or None instead); a key in ``reserved`` at the top level (zerostall
    writes it itself); anything else, and non-``str`` keys, as
    :class:`~zerostall.errors.MetadataTypeError`. The error's ``key`` is the entry's path,
    ``"a/b/0"``.

    >>> import numpy as np
    >>> clean_metadata({"loss": np.float32(0.5), "tags": ("a", "b")})
    {'loss': 0.5, 'tags': ['a', 'b']}
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise MetadataTypeError(f"metadata must be a dict, got {_short(metadata)}", argument="metadata", path=path)
    for key in reserved:
        if key in metadata:
            raise MetadataError(f"metadata key {key!r} is reserved: zerostall stores it itself", key=key,
                                argument="metadata", path=path)
    out = _clean(metadata, "", 0, path)
    assert isinstance(out, dict)
    return out


def _clean(value: object, key: str, depth: int, path: str | None) -> Any:
    if depth > MAX_METADATA_DEPTH:
        raise MetadataError(f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep (a cycle?)",
                            key=key or None, argument="metadata", path=path)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # an IntEnum or int subclass becomes a plain int
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MetadataError(f"metadata value {value!r} is not valid JSON (manifests are strict JSON); "
                                "store str(x) or None instead", key=key or None, argument="metadata", path=path)
        return float(value)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        item = value.item()
        if isinstance(item, (bool, int, float, str)) or item is None:
            return _clean(item, key, depth, path)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            sub = f"{key}/{k}" if key else str(k)
            if not isinstance(k, str):
                raise MetadataTypeError(f"metadata keys must be str, got {_short(k)}", key=sub,
                                        argument="metadata", path=path)
            out[k] = _clean(v, sub, depth + 1, path)
        return out
    if isinstance(value, (list, tuple)):
        return [_clean(v, f"{key}/{i}" if key else str(i), depth + 1, path) for i, v in enumerate(value)]
    hint = "; call .item() or .tolist() first" if hasattr(value, "tolist") or hasattr(value, "item") else ""
    raise MetadataTypeError(f"metadata value of type {type(value).__name__} is not JSON{hint}", key=key or None,
                            argument="metadata", path=path)


def _short(v: object) -> str:
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not hide the real error
        return f"<{type(v).__name__}>"
    return r if len(r) <= 80 else r[:77] + "..."
