"""Stage: copy a state's arrays into reused host buffers. The only phase the trainer waits for.

Invariants: runs on the training thread; touches no storage and serializes nothing; every byte
is copied exactly once, from the source tensor into its final place in a data-file image.
"""

from zerostall.stage.buffers import BufferPool, HostBuffer, Slot
from zerostall.stage.plan import FilePlan, Plan, make_plan
from zerostall.stage.stager import CopyEngine, CpuCopyEngine, CudaCopyEngine, select_engine, stage

__all__ = [
    "BufferPool", "HostBuffer", "Slot", "FilePlan", "Plan", "make_plan",
    "CopyEngine", "CpuCopyEngine", "CudaCopyEngine", "select_engine", "stage",
]
