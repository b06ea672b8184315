"""The memory tier's parts beyond one host: replicas of a step in another host's memory.

:mod:`zerostall.memtier.replica` moves a staged step between keepers of one job (an
authenticated group, :mod:`zerostall.memtier.auth`) and verifies it end to end;
:mod:`zerostall.memtier.placement` says which keepers hold a rank's replicas. No torch at import
time: the group imports ``torch.distributed`` when it is formed.
"""
