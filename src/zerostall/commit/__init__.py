"""One place decides the commit (:mod:`~zerostall.commit.protocol`), and, for a collective save,
the ranks' one outcome (:mod:`~zerostall.commit.agreement`). Both sides of the trainer/writer
boundary use it: the writer commits, a trainer may abort a collective attempt it failed."""

from zerostall.commit.protocol import (
    Attempt,
    CommitProtocol,
    ManifestLastCommit,
    RenameCommit,
    check_reachable,
    committed_steps,
    delete_checkpoint,
    exists_error,
    is_committed,
    parse_step,
    protocol_for,
    remove_stale_attempts,
    step_name,
    steps_to_delete,
    steps_to_delete_everywhere,
)

__all__ = [
    "Attempt",
    "CommitProtocol",
    "RenameCommit",
    "ManifestLastCommit",
    "protocol_for",
    "exists_error",
    "is_committed",
    "remove_stale_attempts",
    "step_name",
    "parse_step",
    "committed_steps",
    "steps_to_delete",
    "delete_checkpoint",
    "check_reachable",
    "steps_to_delete_everywhere",
]
