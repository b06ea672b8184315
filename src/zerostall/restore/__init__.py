"""Restore: read a committed checkpoint into templates in place, partially, or as saved.

Two passes. The first (:mod:`~zerostall.restore.plan`) walks the manifest's tree against the
template, checks every asked-for leaf (key, shape, dtype), picks where its bytes go and builds
closures that assemble the result. The second (:mod:`~zerostall.restore.read`) reads all ranges
in parallel and verifies checksums (templates on a CUDA device through
:mod:`~zerostall.restore.device`'s pass); then the closures run: copies into strided templates,
custom decoders, ``load_state_dict``. :func:`load_items` is the local load; the
collective load in :mod:`zerostall.distributed` uses the same public planning and reading API.

:func:`verify_checkpoint` checks a whole checkpoint and reports every problem, not the first.
"""

from zerostall.restore import optim as _optim  # noqa: F401 - registers the torch optimizer template
from zerostall.restore.files import DataFiles, check_local_file, read_manifest
from zerostall.restore.load import assemble, load_items, new_planner, plan_items
from zerostall.restore.plan import (
    NodeReader,
    ReadPlanner,
    ReadRequest,
    TemplateBox,
    Thunk,
    register_node_reader,
    register_stateful_template,
)
from zerostall.restore.read import execute_reads, prepare_reads
from zerostall.restore.verify import Problem, VerifyReport, verify_checkpoint

__all__ = [
    "load_items", "read_manifest", "verify_checkpoint", "VerifyReport", "Problem",
    "DataFiles", "check_local_file", "ReadPlanner", "ReadRequest", "TemplateBox", "Thunk",
    "execute_reads", "plan_items", "new_planner", "assemble",
    "prepare_reads",
    "NodeReader", "register_node_reader",
    "register_stateful_template",
]
