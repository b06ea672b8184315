"""Newcomer round 5 (docs/newcomer-run.md, "Round 5"): what a first-time user hit, as regression tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

SRC = str(Path(__file__).parents[1] / "src")
FSDP = Path(__file__).parent / "_newcomer5_fsdp.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(n: int, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(FSDP), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_fsdp2_resume_into_a_fresh_optimizer_on_another_world_size_gets_sharded_moments(tmp_path: Path) -> None:
    # docs/distributed.md: DTensors (FSDP2) reshard N -> M. Loading into a freshly built optimizer
    # (no state yet) used to give every rank the whole global moments as plain tensors, and the
    # next step() failed: "aten.lerp_.Scalar got mixed torch.Tensor and DTensor".
    _torchrun(2, str(tmp_path), "save")
    _torchrun(3, str(tmp_path), "resume")
    for rank in range(3):
        res = json.loads((tmp_path / f"result-resume-{rank}.json").read_text())
        assert "error" not in res, res.get("tb")
        assert res == {"moments_are_dtensors": True, "moments_equal_saved": True, "stepped": True}


_FSIZE_SCRIPT = """
import resource, sys, torch, zerostall
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # what `ulimit -f 1024` does
try:
    zerostall.save_pytree(sys.argv[1], {"w": torch.zeros(1 << 21)})  # 8 MiB
except zerostall.StorageError as exc:
    print("ZS", exc.errno, exc.path, str(exc))
except OSError as exc:
    print("RAW", exc.errno, str(exc))
"""


def test_a_file_size_limit_refusing_the_staging_buffers_names_the_checkpoint_and_ulimit(tmp_path: Path) -> None:
    # The staging buffers are memfd files: RLIMIT_FSIZE refused them with a bare
    # "OSError: [Errno 27] File too large" from stage/buffers.py, no path, not a ZerostallError.
    target = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT, target], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip()
    assert out.startswith("ZS 27 " + target), out
    assert "staging buffers" in out and "ulimit -f" in out, out
    assert not os.path.exists(target)


def test_a_jax_eval_shape_template_restores_a_python_step_counter(tmp_path: Path) -> None:
    # The Orbax way to build a restore template, jax.eval_shape(lambda: state), turns the state's
    # Python `step` into a 0-d ShapeDtypeStruct; the load refused it ("checkpoint has a int here
    # but the template has an array"). It now comes back as an array of the template's dtype.
    import jax
    import jax.numpy as jnp
    import pytest

    import zerostall
    from zerostall.errors import MismatchError

    state = {"w": jnp.arange(4.0), "step": 7, "lr": 0.5, "done": True}
    zerostall.save_pytree(tmp_path / "c", state)
    out = zerostall.load_pytree(tmp_path / "c", jax.eval_shape(lambda: state))
    assert isinstance(out["step"], jax.Array) and int(out["step"]) == 7 and out["step"].dtype == jnp.int32
    assert float(out["lr"]) == 0.5 and bool(out["done"]) is True
    assert bool(jnp.array_equal(out["w"], state["w"]))
    with pytest.raises(MismatchError, match="float 0.5") as err:  # never truncated silently
        zerostall.load_pytree(tmp_path / "c", {"lr": jax.ShapeDtypeStruct((), jnp.int32)})
    assert err.value.key == "pytree/lr"
    with pytest.raises(MismatchError, match="does not fit"):
        zerostall.save_pytree(tmp_path / "d", {"step": 2**40})
        zerostall.load_pytree(tmp_path / "d", {"step": jax.ShapeDtypeStruct((), jnp.int32)})


def test_lightning_last_ckpt_left_empty_by_a_kill_names_the_checkpoints_to_resume_from(tmp_path: Path) -> None:
    # A trainer SIGKILLed during a checkpoint event: epoch=0-step=7.ckpt committed, last.ckpt made
    # (the plugin makes the path at once) while its save still waited for the first one's slot.
    # fit(ckpt_path="last") then picks last.ckpt and failed with only "no committed zerostall
    # checkpoint in this directory", at every restart.
    import pytest

    # Round 6: the newest committed sibling is loaded instead, with a warning naming it
    # (tests/integration/test_lightning_last.py); with none beside it, the error says so.
    from zerostall import ZerostallWarning
    from zerostall.errors import CheckpointNotFoundError
    from zerostall.lightning import ZerostallCheckpointIO

    io = ZerostallCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0, "global_step": 7},
                       tmp_path / "epoch=0-step=7.ckpt")
    io.teardown()
    (tmp_path / "last.ckpt").mkdir()
    with pytest.warns(ZerostallWarning) as caught:
        assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 7
    msg = str(caught[0].message)
    assert "first save never committed" in msg and "epoch=0-step=7.ckpt" in msg, msg
    assert io.load_checkpoint(tmp_path / "epoch=0-step=7.ckpt")["global_step"] == 7
    (tmp_path / "epoch=0-step=7.ckpt").rename(tmp_path / ".gone")
    with pytest.raises(CheckpointNotFoundError, match="nothing beside it holds a committed save"):
        io.load_checkpoint(tmp_path / "last.ckpt")


_FSIZE_LEAK_SCRIPT = """
import os, resource, sys, torch, zerostall
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
def memfds():
    return sum(1 for f in os.listdir("/proc/self/fd") if "memfd" in os.path.realpath(f"/proc/self/fd/{f}"))
before = memfds()
for i in range(5):
    try:
        zerostall.save_pytree(os.path.join(sys.argv[1], str(i)), {"w": torch.zeros(1 << 21)})
    except OSError:
        pass
print(memfds() - before)
"""


def test_staging_buffers_refused_by_the_os_leak_no_memfd(tmp_path: Path) -> None:
    # Each refused HostBuffer kept its memfd descriptor open (5 failed saves: 5 leaked fds).
    proc = subprocess.run([sys.executable, "-c", _FSIZE_LEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "0", proc.stdout


def test_cli_given_a_file_says_what_it_is_and_what_to_pass(tmp_path: Path, capsys: object) -> None:
    # `zerostall inspect model.pt` / `verify CKPT/data/rank-00000.safetensors` answered only
    # "[ENOTDIR] cannot stat the manifest manifest.json: Not a directory".
    import zerostall
    from zerostall.cli import main

    ckpt = tmp_path / "ck"
    zerostall.save_pytree(ckpt, {"w": torch.ones(2)})
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    data = next((ckpt / "data").iterdir())
    assert main(["verify", str(data)]) == 1
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "is a file, not a checkpoint" in err and f"data file of the checkpoint {ckpt}" in err, err
    assert main(["inspect", str(tmp_path / "model.pt")]) == 1
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "is a file, not a checkpoint" in err and "zerostall import FILE DST" in err, err
    assert main(["inspect", "--json", str(tmp_path / "model.pt")]) == 1
    doc = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert doc["error"]["class"] == "StorageError" and doc["error"]["errno"] == 20


def test_a_fresh_fused_adamw_over_a_channels_last_cnn_resumes_bit_for_bit(tmp_path: Path) -> None:
    # Silent: a restarted job's fresh optimizer got its moments back as new *contiguous* tensors
    # while the channels_last parameters are not; fused AdamW pairs elements by memory position,
    # so every step after the resume used scrambled moments (0.02 off after 2 steps at lr 1e-2).
    import zerostall

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer, i: int) -> None:
        x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(i))
        m(x.to(memory_format=torch.channels_last)).square().mean().backward()
        o.step()
        o.zero_grad()

    ma, oa = build()
    for i in range(1, 4):
        step(ma, oa, i)
    zerostall.save_pytree(tmp_path / "c", {"m": ma, "o": oa})
    mb, ob = build()
    zerostall.load_pytree(tmp_path / "c", {"m": mb, "o": ob})
    pa, pb = ma[0].weight, mb[0].weight
    assert ob.state[pb]["exp_avg"].stride() == oa.state[pa]["exp_avg"].stride() == pb.stride()
    assert torch.equal(ob.state[pb]["exp_avg"], oa.state[pa]["exp_avg"])
    assert type(ob.state[pb]["step"]) is type(oa.state[pa]["step"])
    for i in range(4, 6):
        step(ma, oa, i)
        step(mb, ob, i)
    for k, v in ma.state_dict().items():
        assert torch.equal(v, mb.state_dict()[k]), k


def test_inspect_of_an_fsdp2_checkpoint_shows_where_each_shard_lies(tmp_path: Path, capsys: object) -> None:
    # `zerostall inspect` listed "pytree/model/0.weight F32 19x13" and "... 18x13": nothing said
    # they are the two halves of one 37x13 tensor.
    from zerostall.cli import main

    _torchrun(2, str(tmp_path), "save")
    step = str(tmp_path / "run" / "step_00000003")
    assert main(["inspect", "--json", step]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["leaves"]  # type: ignore[attr-defined]
            if r["key"] == "pytree/model/0.weight"]
    assert sorted((r["shard"]["offset"], r["shape"]) for r in rows) == [([0, 0], [19, 13]), ([19, 0], [18, 13])]
    assert all(r["shard"]["global"] == [37, 13] for r in rows)
    # Each box was saved by one rank; every rank's tree lists both boxes, which made both "all".
    assert sorted((r["shard"]["offset"], r["ranks"]) for r in rows) == [([0, 0], [0]), ([19, 0], [1])]
    assert main(["inspect", step]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "19x13 @0,0 of 37x13" in out and "18x13 @19,0 of 37x13" in out, out


def test_nested_tensor_is_refused_by_key_not_by_a_torch_internal_error(tmp_path: Path) -> None:
    # A strided nested tensor reached `tuple(t.shape)`: torch's RuntimeError ("NestedTensorImpl
    # doesn't support sizes"), no key, not a ZerostallError.
    import zerostall
    from zerostall.errors import UnsupportedLeafError

    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    try:
        zerostall.save_pytree(tmp_path / "n", {"batch": nt})
    except UnsupportedLeafError as exc:
        assert exc.key == "pytree/batch" and "unbind" in str(exc)
    else:  # pragma: no cover - the assertion below says what went wrong
        raise AssertionError("a nested tensor was saved")


def test_random_generators_are_told_what_to_save_and_that_works(tmp_path: Path) -> None:
    # The refusal said "save its state_dict()", which none of these has.
    import random

    import numpy as np

    import zerostall
    from zerostall.errors import UnsupportedLeafError

    r, g, t = random.Random(5), np.random.default_rng(7), torch.Generator().manual_seed(3)
    for obj, advice in ((t, "get_state()"), (g, "bit_generator.state"), (r, "getstate()")):
        try:
            zerostall.save_pytree(tmp_path / "bad", {"rng": obj})
        except UnsupportedLeafError as exc:
            assert advice in str(exc) and "state_dict()" not in str(exc), str(exc)
        else:  # pragma: no cover
            raise AssertionError(f"{type(obj)} was saved")
    # what the message says to do round-trips
    zerostall.save_pytree(tmp_path / "ok", {"r": r.getstate(), "g": g.bit_generator.state, "t": t.get_state()})
    d = zerostall.load_pytree(tmp_path / "ok")
    r2, g2, t2 = random.Random(), np.random.default_rng(), torch.Generator()
    r2.setstate(d["r"])
    g2.bit_generator.state = d["g"]
    t2.set_state(d["t"])
    assert r2.random() == r.random() and g2.random() == g.random()
    assert torch.equal(torch.rand(3, generator=t2), torch.rand(3, generator=t))
