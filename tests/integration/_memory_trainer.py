"""A trainer for the memory-tier tests: saves steps with a memory tier, then dies or closes.

``python _memory_trainer.py DIR FIRST LAST PERSIST_EVERY LINGER_S MODE`` saves steps FIRST..LAST
(each waited for), printing ``SAVED <step> <tiers>``; MODE ``kill`` SIGKILLs itself after the
last, ``close`` closes cleanly, ``loop`` keeps saving (without waiting) until killed.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

from zerostall import Checkpointer, MemoryTier


def state(step: int, big: bool = False) -> dict:
    n = 1 << (19 if big else 10)
    return {
        "w": (np.arange(n, dtype=np.float32) + step) / 3,
        "i": np.full(17, step, dtype=np.int64),
        "h": (np.arange(33, dtype=np.float16) * step) / 7,
        "flags": (np.arange(9) % (step % 3 + 2)) == 0,
        "step": step,
        "tag": f"run-{step}".encode(),
        "nested": {"list": [step, float(step) / 7, None]},
    }


def main() -> None:
    directory, first, last, every, linger, mode = sys.argv[1:7]
    ckpt = Checkpointer(directory, memory_tier=MemoryTier(persist_interval_steps=int(every),
                                                          linger_s=float(linger)))
    print("KEEPER", ckpt._engine.writer.pid, flush=True)
    big = mode == "loop"
    step = int(first)
    while True:
        r = ckpt.save_pytree_async(step, state(step, big))
        if mode == "loop":
            print("SUBMITTED", step, flush=True)
            r.add_done_callback(lambda r, s=step: print("SAVED", s, ",".join(r.stats.tiers), flush=True))
        else:
            r.result()
            print("SAVED", step, ",".join(r.stats.tiers), flush=True)
            if step == int(last):
                break
        step += 1
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()


if __name__ == "__main__":
    main()
