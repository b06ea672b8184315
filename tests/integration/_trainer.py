"""A trainer process for crash tests: saves asynchronously, says so, then waits to be killed.

usage: _trainer.py DIR STEP MIB
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from _helpers import make_state

import zerostall

directory, step, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ck = zerostall.Checkpointer(directory)
state = make_state(mib, seed=step)
ck.save_pytree_async(step, state)
print(f"RETURNED {ck._engine.writer.pid}", flush=True)
for t in state["model"].values():  # the trainer goes on mutating its state
    t.zero_()
time.sleep(600)
