"""The memory tier: every save held in this host's memory, some persisted, a restart from memory.

On one host: :mod:`zerostall.memtier.keeper` is the keeper process (its own entry point, the
writer's loop with held steps); :mod:`zerostall.memtier.spec` names, adopts and asks a keeper;
:mod:`zerostall.memtier.keeperfail` keeps its failed persists; :mod:`zerostall.memtier.instance`
tells a directory from a new one at the same path; :mod:`zerostall.memtier.imagecheck` checks a
held step after a crash; :mod:`zerostall.memtier.image` reads a held step as storage (the
``zsimage`` scheme, registered when imported) and :mod:`zerostall.memtier.premap` maps an adopted
keeper's step in the background.

Beyond one host: :mod:`zerostall.memtier.replica` moves a staged step between keepers of one job
(an authenticated group, :mod:`zerostall.memtier.auth`) and verifies it end to end;
:mod:`zerostall.memtier.placement` says which keepers hold a rank's replicas. No torch at import
time: the group imports ``torch.distributed`` when it is formed.

Nothing is imported here: the modules sit at different layers of the import contract.
"""
