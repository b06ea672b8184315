"""The error tree drawn in zerostall.errors is complete, and every error class crosses processes by name."""

from __future__ import annotations

import dataclasses
import errno
import importlib
import pkgutil
import re

import pytest

import zerostall
from zerostall import errors
from zerostall.memtier.keeperfail import UnadoptableKeeper
from zerostall.messages import from_wire, to_wire


def _all_error_classes() -> set[type[errors.ZerostallError]]:
    for mod in pkgutil.walk_packages(zerostall.__path__, "zerostall."):
        if mod.name.startswith(("zerostall.integrations.", "zerostall.lightning", "zerostall.__main__")):
            continue  # optional dependencies; their modules define no error classes
        importlib.import_module(mod.name)
    found: set[type[errors.ZerostallError]] = set()
    todo: list[type[errors.ZerostallError]] = [errors.ZerostallError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("zerostall") and cls not in found:
            found.add(cls)
            todo.extend(cls.__subclasses__())
    return found


def test_the_drawn_tree_names_every_error_class_of_the_package():
    doc = errors.__doc__ or ""
    missing = sorted(c.__name__ for c in _all_error_classes() if f" {c.__name__}" not in doc)
    assert not missing, f"errors.py's tree does not draw {missing}"
    assert "ZerostallWarning" in doc


def test_the_drawn_tree_names_only_classes_the_package_has():
    drawn = set(re.findall(r"[├└]── (\w+)", errors.__doc__ or ""))
    assert drawn, "the tree's branches were not found"
    stale = sorted(drawn - {c.__name__ for c in _all_error_classes()})
    assert not stale, f"errors.py's tree draws {stale}, which the package does not define"


def test_an_unadoptable_keeper_is_a_plain_record_not_an_error():
    """Never raised, so not an exception: a frozen record with the fields every entry of
    Checkpointer.keeper_failures has (step, path, rank, cause, errno)."""
    cause = errors.StorageError("bind refused", errno=errno.EACCES)
    record = UnadoptableKeeper(path="/ckpt", rank=0, keeper_pid=42, cause=cause)
    assert not isinstance(record, BaseException)
    assert record.step is None and record.errno == errno.EACCES and record.cause is cause
    assert "pid 42, rank 0" in str(record) and "[EACCES] bind refused" in str(record) and "'/ckpt'" in str(record)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize("cls", sorted(
    (c for c in _all_error_classes() if c.__module__ == "zerostall.errors"), key=lambda c: c.__name__))
def test_every_error_class_of_the_errors_module_comes_back_as_itself_from_the_wire(cls):
    exc = cls("it broke", path="/ckpt/step_00000007", key="model/w", rank=3)
    back = from_wire(to_wire(exc))
    assert type(back) is cls
    assert (back.path, back.key, back.rank, back.message) == ("/ckpt/step_00000007", "model/w", 3, "it broke")


def test_an_unknown_class_name_comes_back_as_a_writer_error():
    assert errors.wire_class("ErrorOfANewerVersion") is errors.WriterError
