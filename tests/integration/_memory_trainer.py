"""A trainer for the memory-tier tests: saves steps with a memory tier, then dies or closes.

``python _memory_trainer.py DIR FIRST LAST PERSIST_EVERY LINGER_S MODE`` saves steps FIRST..LAST
(each waited for), printing ``SAVED <step> <tiers>``; MODE ``kill`` SIGKILLs itself after the
last, ``close`` closes cleanly, ``loop`` keeps saving (without waiting) until killed,
``corrupt`` flips one byte of leaf ``w`` in the step its keeper holds (through the keeper's own
descriptor, mapped writable: after the commit, as a stray write would) and then SIGKILLs itself.
"""

from __future__ import annotations

import mmap
import os
import signal
import sys

import numpy as np

from zerostall import Checkpointer, MemoryTier
from zerostall.format.manifest import parse_manifest


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
            _say(f"SUBMITTED {step}")
            r.add_done_callback(lambda r, s=step: _say(f"SAVED {s} {','.join(r.stats.tiers)}"))
        else:
            r.result()
            _say(f"SAVED {step} {','.join(r.stats.tiers)}")
            if step == int(last):
                break
        step += 1
    if mode == "corrupt":
        _corrupt_held(ckpt)
    if mode in ("kill", "corrupt"):
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()


def _say(line: str) -> None:
    # One write per line: print() writes the text and the newline apart, and the done callback's
    # thread and the main thread could interleave them ("SAVED SUBMITTED 6 ...").
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _corrupt_held(ckpt: Checkpointer) -> None:
    got = ckpt._memory.keeper.query_image()
    assert got is not None
    img, fds = got
    m = parse_manifest(img.manifest.encode(), path="memory")
    leaf = next(lf for lf in m.leaves if lf.key.split("/")[-1] == "w")
    name = m.files[leaf.file].path.rsplit("/", 1)[-1]
    i = next(j for j, f in enumerate(img.files) if f.name == name)
    with mmap.mmap(fds[i], img.files[i].size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mem:
        mem[leaf.offset + 5] ^= 0x40
    print("CORRUPTED", leaf.key, flush=True)


if __name__ == "__main__":
    main()
