"""A training loop with ``Checkpointer(preemption_signals=(SIGTERM,))`` for the preemption tests.

``python _preempt_trainer.py solo DIR PAUSE``, ``python _preempt_trainer.py RANK WORLD PORT DIR PAUSE``
(gloo ranks; each step all-reduces, as DDP does) or, under torchrun, ``_preempt_trainer.py env DIR PAUSE``. Every step is saved to the memory tier only
(``persist_interval_steps`` is far away). With ``PAUSE > 0``, after the save of step PAUSE is in
memory the loop prints ``HELD PAUSE`` and rank 0 waits for ``DIR/go`` inside that step (a long
step); the other ranks go on into the next step's all-reduce and wait there, inside a C call where
no Python signal handler runs. The test can then see what a signal does before the next step. With ``PAUSE == 0`` it runs on (a step
every 20 ms). It stops when ``ckpt.preempted`` says so, printing ``FINAL <step>`` and, after
``close()``, ``CLOSED <memory-only step persisted at once or -1> <handler restored>``.

``ZS_GRACE_S`` sets ``preemption_grace_s``. A ``PreemptionError`` from ``should_save`` prints
``PREEMPTION_ERROR <message>`` and ends the process at once, as a crash; with ``ZS_STORE_OUTLIVES=1``
rank 0, whose process hosts the job's store here, first waits (bounded) until every other rank has
printed its own (each touches ``DIR/ended-RANK``), as torchrun's agent, which hosts the store there,
outlives its ranks.

Under torchrun, ``env DIR 0 LAG WHERE`` makes rank 1 lag ``LAG`` seconds: with ``WHERE=save``
before its save of step 8 (every 4th step persists, so that save is collective and needs rank 1's
share), rank 0 printing ``SAVED 8`` once its ``save_pytree_async(8)`` returned; with
``WHERE=collective`` before its all-reduce of step 9, rank 0 printing ``ENTER 9`` as it goes into
that all-reduce and waits there. Those runs keep the job's default ``timeout_s`` (300 s).

The solo loop installs its own SIGTERM handler first (printing ``USER HANDLER``): zerostall must chain to it.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch

from zerostall import Checkpointer, DistributedOptions, MemoryTier, SaveOptions
from zerostall.errors import PreemptionError

STEPS = 100_000  # far more than any test waits for: the loop ends only when preempted
#: with a lag: the step rank 1 is late for (a persisted save: every LAG_PERSIST_EVERY-th is)
LAG_AT, LAG_PERSIST_EVERY = 8, 4


def say(*words: object) -> None:
    """One line in one write: torchrun's workers share its stdout, and an unbuffered print writes
    each word apart, so two workers' lines could interleave."""
    os.write(1, (" ".join(map(str, words)) + "\n").encode())


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit("no go file")
        time.sleep(0.01)


def main() -> None:
    solo = sys.argv[1] == "solo"
    lag, where = 0.0, ""
    if solo:
        rank, world, d, pause = 0, 1, sys.argv[2], int(sys.argv[3])

        def user(signum: int, frame: object) -> None:
            say("USER HANDLER", signum)

        signal.signal(signal.SIGTERM, user)
        previous = user
    elif sys.argv[1] == "env":  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        import torch.distributed as dist

        d, pause = sys.argv[2], int(sys.argv[3])
        if len(sys.argv) > 4:
            lag, where = float(sys.argv[4]), sys.argv[5]
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        rank, world = dist.get_rank(), dist.get_world_size()
        previous = signal.getsignal(signal.SIGTERM)
    else:
        import torch.distributed as dist

        rank, world, port, d, pause = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                       int(sys.argv[5]))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        previous = signal.getsignal(signal.SIGTERM)
    if lag:  # the job's default timeout_s (300 s): the notice must bound its waits by the grace alone
        opts, every = SaveOptions(distributed=DistributedOptions(poll_s=0.02)), LAG_PERSIST_EVERY
    else:
        opts, every = SaveOptions(distributed=DistributedOptions(timeout_s=30.0, poll_s=0.02)), 1_000_000
    ck = Checkpointer(d, save_options=opts, memory_tier=MemoryTier(persist_interval_steps=every, linger_s=0.0),
                      preemption_signals=(signal.SIGTERM,),
                      preemption_grace_s=float(os.environ.get("ZS_GRACE_S", "20")))
    w = torch.zeros(256, 64)
    for step in range(1, STEPS):
        w += 1.0
        if not solo:
            if lag and where == "collective" and step == LAG_AT + 1:
                if rank == 1:
                    time.sleep(lag)
                else:
                    say("ENTER", step)  # rank 0 waits in this all-reduce for rank 1
            dist.all_reduce(w)
            w /= world
        if lag and where == "save" and step == LAG_AT and rank == 1:
            time.sleep(lag)  # rank 1 reaches its (persisted) save of this step after rank 0
        try:
            due = ck.should_save(step)
        except PreemptionError as exc:  # the ranks could not agree: leave as a crash (the keepers persist)
            say("PREEMPTION_ERROR", str(exc).replace("\n", " "))
            if os.environ.get("ZS_STORE_OUTLIVES") == "1":
                open(os.path.join(d, f"ended-{rank}"), "w").close()
                if rank == 0:
                    for r in range(1, world):
                        _wait_for(os.path.join(d, f"ended-{r}"))
            os._exit(3)
        if due:
            r = ck.save_pytree_async(step, {"w": w, "rank": rank})
            if lag and step == LAG_AT and rank == 0:
                say("SAVED", step)
            if step == pause:
                r.result()
                say("HELD", step)
                if rank == 0:
                    _wait_for(os.path.join(d, "go"))
        if ck.preempted:
            say("FINAL", step)
            break
        if pause == 0:
            time.sleep(0.02)
        say("STEP", step)
    preemption = ck._preemption
    ck.close()  # returns once the immediate persist the notice started has ended
    held = preemption.held_persisted if preemption is not None else None
    say("CLOSED", -1 if held is None else held, signal.getsignal(signal.SIGTERM) == previous)
    if not solo:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
