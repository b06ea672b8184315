"""Running code that file permissions apply to, also when the suite runs as root."""

from __future__ import annotations

import os
import subprocess
import sys


def as_user_without_dac(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that file permissions apply to: as root, one without
    CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (so a mode-000 folder is unreadable to it too)."""
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ))
