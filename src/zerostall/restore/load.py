"""A local load: read the manifest, plan against the templates, read, verify, assemble."""

from __future__ import annotations

from typing import Any

from zerostall.errors import MismatchError, MissingKeyError, ZerostallError
from zerostall.format.manifest import Manifest
from zerostall.gcpause import paused_gc
from zerostall.options import LoadOptions
from zerostall.restore.files import DataFiles, read_manifest
from zerostall.restore.plan import ReadPlanner, Thunk
from zerostall.restore.read import execute_reads
from zerostall.storage import Storage, open_storage

__all__ = ["load_items", "plan_items", "new_planner", "assemble"]


def plan_items(planner: ReadPlanner, tree: dict[str, Any], items: dict[str, Any] | None) -> dict[str, Thunk]:
    """Plan ``{item name: template or None}`` (``None``: every item of ``tree``) against ``tree``.

    Raises:
        MissingKeyError: an item is not in the checkpoint.
        MismatchError: a template disagrees with the checkpoint (shape, dtype, kind).
    """
    wanted = {k: None for k in tree} if items is None else items
    thunks: dict[str, Thunk] = {}
    for item, tmpl in wanted.items():
        if item not in tree:
            raise MissingKeyError(f"the checkpoint has no item {item!r} (it has {sorted(tree)})",
                                  path=planner.path, key=item)
        thunks[item] = planner.build(tree[item], tmpl, item)
    return thunks


def new_planner(storage: Storage, name: str, m: Manifest, path: str) -> ReadPlanner:
    return ReadPlanner(m, path, DataFiles(storage, name, m, path))


def load_items(root_url: str, name: str, items: dict[str, Any] | None, options: LoadOptions | None = None,
               ) -> dict[str, Any]:
    """Load ``{item name: template or None}`` (``None``: every item, as saved) from a checkpoint."""
    # A manifest of many leaves and its plan allocate a few objects per leaf: see zerostall.gcpause.
    # The pause ends once _load_items has returned, so that the manifest and the plan are freed by
    # then and the collector's next pass does not walk them.
    with paused_gc():
        return _load_items(root_url, name, items, options)


def _load_items(root_url: str, name: str, items: dict[str, Any] | None, options: LoadOptions | None,
                ) -> dict[str, Any]:
    opts = options or LoadOptions()
    path = f"{root_url.rstrip('/')}/{name}"
    storage = open_storage(root_url)
    m = read_manifest(storage, name, path=path)
    planner = new_planner(storage, name, m, path)
    thunks = plan_items(planner, m.items, items)
    execute_reads(storage, name, m, planner.reads, opts, path)
    return assemble(thunks, path)


def assemble(thunks: dict[str, Thunk], path: str) -> dict[str, Any]:
    """Run the planned thunks once every byte is in: copies, decoders, ``load_state_dict``."""
    try:
        return {k: th() for k, th in thunks.items()}
    except ZerostallError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        # load_state_dict of a user object refused the restored state
        raise MismatchError(f"restoring into the template failed: {type(exc).__name__}: {exc}", path=path) from exc
