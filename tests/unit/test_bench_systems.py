"""The benchmark suite's systems (``benchmarks/zs.py``, ``peers.py``, ``dip.py``, ``warm_pair.py``):
each one `make bench` times can save and restore.

A system class that leaves ``save`` or ``restore`` to ``measure.System`` raises
``NotImplementedError`` in its child, and the suite then has no row for it: a run of half an hour
to find out, so it is checked here in seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import inspect, sys
from pathlib import Path
from benchmarks import dip, measure, peers, zs
from benchmarks.state import build_state

missing = []
# measure_system times save and restore; the dip only saves
for mod, methods in ((zs, ("save", "restore")), (peers, ("save", "restore")), (dip, ("save",))):
    for name, cls in inspect.getmembers(mod, inspect.isclass):
        if issubclass(cls, measure.System) and cls is not measure.System and not name.startswith("_"):
            for method in methods:
                if getattr(cls, method) is getattr(measure.System, method):
                    missing.append(f"{mod.__name__}.{name}.{method}")
assert not missing, f"not implemented: {missing}"

system = zs.Zerostall()
d = Path(sys.argv[1])
system.setup(d)
state = build_state(4 << 20)
system.save(d / "c", state).wait()
template = system.template(state)
restored = system.restore(d / "c", template)
assert system.equal(state, restored)
for name, fn in system.restore_variants().items():
    assert system.equal(state, fn(d / "c", system.template(state))), name
system.close()
print("ok")
"""


def _run(script: str, tmp_path: Path) -> None:
    """``script`` in a fresh interpreter with the repository importable; it prints ``ok`` last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


def test_every_benchmarked_system_saves_and_restores(tmp_path: Path) -> None:
    _run(_SCRIPT, tmp_path)


def test_the_paired_warm_restore_loads_both_and_checks_the_template(tmp_path: Path) -> None:
    # benchmarks/warm_pair.py: make bench's "warm restore faster than safetensors" verdict
    script = ("import sys; from pathlib import Path; from benchmarks import warm_pair; "
              "out = warm_pair.run(4 << 20, Path(sys.argv[1]), 3); "
              "assert out['correct'] and len(out['st_x_zs']) == 3, out; "
              "assert all(len(v) == 3 and min(v) > 0 for v in out['warm_s'].values()), out; print('ok')")
    _run(script, tmp_path)
    assert not list(tmp_path.iterdir())  # both files are removed
