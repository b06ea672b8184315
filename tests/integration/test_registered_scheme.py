"""A storage scheme from outside zerostall reaches the writer process.

The backend lives in a module written to a temporary directory (not part of the package): added
with ``register_scheme`` in this process, or declared as an entry point of group
``zerostall.storage`` by a distribution found on the path. Saves go through the default writer,
a separate interpreter, and are loaded back; the backend records the pid of every process that
opened it, so the writer's use of it is seen, not assumed. A writer that cannot import the
registering module fails the save with an error naming the scheme. A backend that declares no
capabilities is refused; one that declares no probe is checked by listing its root, its own
``probe`` left alone.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import InvalidArgumentError, MissingDependencyError, StorageError
from zerostall.storage import _REFERENCES, _REGISTERED, Capabilities, open_storage, register_scheme

PLUGIN = '''
"""A storage backend defined outside zerostall: a local directory that logs who opened it."""

import os

from zerostall.storage.local import LocalStorage


class PluginStorage(LocalStorage):
    def __init__(self, root_url: str) -> None:
        path = root_url.split("://", 1)[1]
        super().__init__(path)
        self.url = root_url
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(os.path.join(os.path.dirname(path), "opened-by"), "a") as f:
            f.write(f"{os.getpid()}\\n")
'''


def _state() -> dict[str, Any]:
    return {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}


def _plugin(where: Path, module: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{module}.py").write_text(textwrap.dedent(PLUGIN))


@pytest.fixture
def scheme() -> Iterator[str]:
    name = f"zsplug{uuid.uuid4().hex[:8]}"
    yield name
    _REGISTERED.pop(name, None)
    _REFERENCES.pop(name, None)


def _save_and_load(url: str, run: Path) -> None:
    state = _state()
    with Checkpointer(url, save_options=SaveOptions(writer=WriterKind.PROCESS)) as c:
        c.save_pytree(3, state)
        c.wait()
        assert c.latest_step() == 3
        out = c.load_pytree(3)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert (run / "step_00000003" / "manifest.json").is_file()  # the plugin wrote where it says
    pids = {int(p) for p in (run.parent / "opened-by").read_text().split()}
    assert pids - {os.getpid()}, "the writer process never opened the plugin's storage"


def test_a_registered_scheme_saves_through_the_writer_process(tmp_path: Path, scheme: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    module = f"zs_plugin_{uuid.uuid4().hex[:8]}"
    _plugin(tmp_path / "plugins", module)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "plugins"))  # where the writer finds it too
    register_scheme(scheme, importlib.import_module(module).PluginStorage)
    run = tmp_path / "data" / "run"
    _save_and_load(f"{scheme}://{run}", run)


def test_a_scheme_the_writer_cannot_import_fails_the_save_naming_it(tmp_path: Path, scheme: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    module = f"zs_plugin_{uuid.uuid4().hex[:8]}"
    _plugin(tmp_path / "plugins", module)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))  # importable here, not in the writer
    monkeypatch.delenv("PYTHONPATH", raising=False)
    register_scheme(scheme, importlib.import_module(module).PluginStorage)
    run = tmp_path / "data" / "run"
    with (Checkpointer(f"{scheme}://{run}", save_options=SaveOptions(writer=WriterKind.PROCESS)) as c,
          pytest.raises(MissingDependencyError) as info):
        c.save_pytree(1, _state())
        c.wait()
    assert f"{scheme}://" in str(info.value) and module in str(info.value)
    assert not (run / "step_00000001").exists()


def test_an_entry_point_scheme_saves_through_the_writer_process(tmp_path: Path, scheme: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A distribution on the path declaring the backend: nothing is registered in this process.
    module = f"zs_plugin_{uuid.uuid4().hex[:8]}"
    site = tmp_path / "site"
    _plugin(site, module)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[zerostall.storage]\n{scheme} = {module}:PluginStorage\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    run = tmp_path / "data" / "run"
    _save_and_load(f"{scheme}://{run}", run)


def test_a_backend_without_declared_capabilities_is_refused(scheme: str) -> None:
    class Undeclared:
        url = "x"

    register_scheme(scheme, lambda url: Undeclared())  # type: ignore[arg-type,return-value]
    with pytest.raises(InvalidArgumentError, match="declares no capabilities"):
        open_storage(f"{scheme}://root")


def test_an_unloadable_entry_point_names_its_scheme(tmp_path: Path, scheme: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "zs_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zs_broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[zerostall.storage]\n{scheme} = zs_no_such_module:Storage\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingDependencyError, match=f"{scheme}://"):
        zerostall.load_pytree(f"{scheme}://{tmp_path}/run")
    assert sys.modules.get("zs_no_such_module") is None


def test_a_backend_that_declares_no_probe_is_checked_by_listing_its_root(scheme: str) -> None:
    from zerostall.commit import check_reachable
    from zerostall.storage.memory import MemoryStorage

    calls: list[str] = []

    class Unprobed(MemoryStorage):
        capabilities = Capabilities()  # the inherited probe is there, but not declared: never called

        def probe(self, *, write: bool) -> None:
            calls.append("probe")

        def list(self, prefix: str) -> list[str]:
            calls.append("list")
            raise PermissionError(errno.EACCES, "listing refused", prefix)

    register_scheme(scheme, Unprobed)
    with pytest.raises(StorageError) as info:
        check_reachable(open_storage(f"{scheme}://unprobed"), write=False, path=f"{scheme}://unprobed/run")
    assert calls == ["list"] and info.value.errno == errno.EACCES
