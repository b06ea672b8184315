"""Restore: read a committed checkpoint into templates in place, partially, or as saved.

Two passes. The first walks the manifest's tree against the template, checks every asked-for
leaf (key, shape, dtype), picks where its bytes go (straight into the template tensor's memory
when it is a contiguous CPU tensor; else a fresh host buffer) and builds a closure that
assembles the result. The second reads all ranges in parallel, verifies checksums, and runs
the closures: copies into device / strided templates, custom decoders, ``load_state_dict``.

:func:`verify_checkpoint` checks a whole checkpoint and reports every problem, not the first.
"""

from zerostall.restore.reader import load_items, read_manifest
from zerostall.restore.verify import Problem, VerifyReport, verify_checkpoint

__all__ = ["load_items", "read_manifest", "verify_checkpoint", "VerifyReport", "Problem"]
