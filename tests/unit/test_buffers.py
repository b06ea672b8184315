"""The staging buffers (``stage.buffers``) refused by the OS: a file-size limit (``ulimit -f``)
refuses their memfd files; the error names the checkpoint and the limit, and leaks no descriptor.

Each case runs in a fresh interpreter, since it lowers RLIMIT_FSIZE for the whole process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).parents[2] / "src")

_FSIZE_SCRIPT = """
import resource, sys, torch, zerostall
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # what `ulimit -f 1024` does
try:
    zerostall.save_pytree(sys.argv[1], {"w": torch.zeros(1 << 21)})  # 8 MiB
except zerostall.errors.StorageError as exc:
    print("ZS", exc.errno, exc.path, str(exc))
except OSError as exc:
    print("RAW", exc.errno, str(exc))
"""


def test_a_file_size_limit_refusing_the_staging_buffers_names_the_checkpoint_and_ulimit(tmp_path: Path) -> None:
    # The staging buffers are memfd files, so RLIMIT_FSIZE applies to them: the OSError
    # ("[Errno 27] File too large") comes back as a StorageError naming the checkpoint and the limit.
    target = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT, target], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip()
    assert out.startswith("ZS 27 " + target), out
    assert "staging buffers" in out and "ulimit -f" in out, out
    assert not os.path.exists(target)


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
    # A HostBuffer the OS refuses closes its memfd: five failed saves leave no descriptor open.
    proc = subprocess.run([sys.executable, "-c", _FSIZE_LEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "0", proc.stdout
