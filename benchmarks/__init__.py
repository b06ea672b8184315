"""zerostall benchmark suite: stall, persist, restore and training dip against floors and peers.

Run ``python benchmarks/run.py --quick`` (see ``run.py``). Every system is measured in its own
child process so that peak RSS, first-save costs and leftover threads of one system never leak
into another's numbers; all of them are compared with floors measured in the same run.
"""
