"""What each entry point imports: the writer, the keeper and the CLI start without the save and
load API (``zerostall/__init__`` loads its public names on first use), and every public name
still resolves from ``zerostall``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
#: modules of the trainer's side: the save and load API and what only it needs
API = ("zerostall.api", "zerostall.checkpointer", "zerostall.engine", "zerostall.distributed", "zerostall.interop",
       "zerostall.persist.client")


def _loaded_after(statement: str) -> set[str]:
    """The zerostall modules a fresh interpreter holds after ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('zerostall'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=SRC))
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("entry", ["zerostall.persist.server", "zerostall.memtier.keeper", "zerostall.cli"])
def test_the_writer_keeper_and_cli_start_without_the_save_and_load_api(entry: str) -> None:
    loaded = _loaded_after(f"import {entry}")
    assert entry in loaded
    assert not loaded & set(API), sorted(loaded & set(API))


def test_import_zerostall_loads_the_errors_and_each_public_name_on_first_use() -> None:
    assert _loaded_after("import zerostall") == {"zerostall", "zerostall._version", "zerostall.errors"}
    loaded = _loaded_after("import zerostall\nassert zerostall.Checkpointer.__name__ == 'Checkpointer'\n"
                           "assert all(getattr(zerostall, n) is not None for n in zerostall.__all__)")
    assert "zerostall.checkpointer" in loaded and "zerostall.api" in loaded


def test_an_unknown_name_is_an_attribute_error() -> None:
    import zerostall

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        zerostall.nope  # noqa: B018
    assert not hasattr(zerostall, "_private")
