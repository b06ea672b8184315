"""`make demo`'s logic, shorter: every claim it prints is checked against the checkpoint directory."""

from __future__ import annotations

import importlib.util
import os
import sys

import zerostall

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _demo():
    spec = importlib.util.spec_from_file_location("zerostall_demo", os.path.join(EXAMPLES, "demo.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["zerostall_demo"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_demo_resumes_from_the_step_it_handed_to_the_writer_before_the_kill(tmp_path):
    demo = _demo()
    r = demo.run_demo(str(tmp_path), steps=12, save_every=2, kill_after=3)
    ckdir = os.path.join(tmp_path, "checkpoints")
    # The third save handed to the writer is step 6; the kill came after it, before any later save.
    assert r.killed_after == 6
    assert r.committed == [2, 4, 6]  # read off the directory after the orphaned writer was done
    # the resumed run committed its own later saves (keep_last=3 rotated the older ones out)
    assert demo.committed_steps(ckdir) == [8, 10, 12]
    with zerostall.Checkpointer(ckdir, read_only=True) as ckpt:
        assert ckpt.latest_step() == 12
    assert r.resumed_from == r.killed_after
    assert r.equal, "the resumed run's final parameters differ from the uninterrupted run"
