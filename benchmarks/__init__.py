"""zerostall benchmark suite: stall, persist, restore and training dip against floors and peers.

Run ``python benchmarks/run.py --quick`` (see ``run.py``). Every system is measured in its own
child process so that peak RSS, first-save costs and leftover threads of one system never leak
into another's numbers; all of them are compared with floors measured in the same run.

``make bench`` runs ``run.py`` (children: ``floors``, ``zs``, ``warm_pair``, ``peers``, ``dip``;
``report`` and ``history`` turn their output into the table and ``reference/history.csv``).
``make bench-gpu`` runs ``gpu.py`` and ``gpu_restore.py``. ``probes/`` holds single-finding probes
the docs cite; ``many_leaves.py`` times per-leaf costs on states of many small tensors;
``replica.py`` (run by hand, not by ``make bench``) times the memory tier's replica transport
against a plain socket copy of the same bytes (docs/design.md, "Replicas in another host's
memory: the transport"). New
benchmarks go beside ``run.py`` and append their figures through ``history.rows`` /
``history.append``.
"""
