"""zerostall.interop: export to safetensors / torch.save files, import torch.save files and DCP checkpoints.

Exports are read back with the other tools' own readers (``safetensors.torch.load_file``,
``torch.load(weights_only=True)``) and compared bit for bit with what was saved.
"""

from __future__ import annotations

import collections
import datetime
import errno
import json
import math
import os
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import zerostall
from zerostall import CorruptCheckpointError, SaveOptions, WriterKind
from zerostall.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    MissingKeyError,
    StorageError,
    UnsupportedFormatError,
    UnsupportedLeafError,
)
from zerostall.interop import ExportReport, ImportReport, export_checkpoint, import_checkpoint
from zerostall.restore import read_manifest
from zerostall.storage import open_storage

THREAD = SaveOptions(writer=WriterKind.THREAD)
Pair = collections.namedtuple("Pair", ["left", "right"])


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.complex64, torch.bool, torch.int8, torch.int64, torch.uint8, torch.uint16, torch.uint32]


def _state() -> dict[Any, Any]:
    base = torch.randn(2, 3, generator=torch.Generator().manual_seed(0)) * 100
    return {
        **{str(dt).removeprefix("torch."): base.to(dt) if dt.is_floating_point or dt.is_complex
           else base.to(torch.int64).to(dt) for dt in DTYPES},
        "scalar_t": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(20.0).reshape(4, 5)[:, 1::2],
        "np": np.arange(6, dtype=np.float64).reshape(2, 3),
        "np_i16": np.arange(-2, 2, dtype=np.int16),
        "np_scalar": np.float32(1.5),
        "nested": {"list": [1, 2.5, "x", None, True], "tuple": (b"raw", -7), "pair": Pair(1, torch.ones(2))},
        3: "int key",
        "a/b": torch.full((2,), 7.0),  # a slash in a key: escaped, never read as nesting
        "50%": 0.1,
        "nan": float("nan"),
        "inf": float("-inf"),
        "big": 2**100,
    }


def _flat(obj: Any, parts: tuple[str, ...] = ()) -> dict[str, Any]:
    """The documented flat view: escaped components joined by '/'; arrays and bytes as tensors."""
    def esc(p: Any) -> str:
        return str(p).replace("%", "%25").replace("/", "%2F")
    if isinstance(obj, dict):
        return {k: v for key, sub in obj.items() for k, v in _flat(sub, (*parts, esc(key))).items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {k: v for f in obj._fields for k, v in _flat(getattr(obj, f), (*parts, f)).items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, sub in enumerate(obj) for k, v in _flat(sub, (*parts, str(i))).items()}
    if isinstance(obj, (np.ndarray, np.generic)):
        obj = torch.from_numpy(np.array(obj))
    if isinstance(obj, bytes):
        obj = torch.frombuffer(bytearray(obj), dtype=torch.uint8)
    return {"/".join(parts): obj}


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _same(a: Any, b: Any) -> None:
    """Bit for bit, with the torch export's conversions: numpy -> tensor, namedtuple -> tuple."""
    if isinstance(a, (np.ndarray, np.generic)):
        a = torch.from_numpy(np.array(a))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        _same_tensor(a, b)
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(b) is (list if isinstance(a, list) else tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    else:
        assert type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("interop") / "ckpt"
    zerostall.save_pytree(path, _state(), metadata={"step": 12}, options=THREAD)
    return path


def _files(d: Path) -> list[str]:
    return sorted(os.listdir(d))


# -- export: safetensors --------------------------------------------------------------------------


def test_safetensors_export_reads_back_bit_for_bit(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "all.safetensors"
    report = export_checkpoint(saved, out)
    tensors = load_file(out)
    want = _flat(_state())
    want_tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
    assert sorted(tensors) == sorted(want_tensors)
    for k, v in want_tensors.items():
        _same_tensor(v, tensors[k])
    assert "a%2Fb" in tensors and "nested/pair/right" in tensors and "nested/tuple/0" in tensors
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    info = json.loads(meta.pop("%zerostall"))
    assert info == {"source": str(saved), "item": None, "metadata": {"step": 12}}
    want_values = {k: v for k, v in want.items() if not isinstance(v, torch.Tensor)}
    assert sorted(meta) == sorted(want_values)
    for k, v in want_values.items():
        got = json.loads(meta[k])
        assert (math.isnan(got) and math.isnan(v)) if isinstance(v, float) and v != v else (got == v and type(got) is type(v)), k
    assert meta["50%25"] == "0.1" and meta["3"] == '"int key"' and meta["big"] == str(2**100)
    assert [urllib.parse.unquote(p) for p in ["a%2Fb"]] == ["a/b"]
    assert report == ExportReport(source=str(saved), path=str(out), format="safetensors", tensors=len(want_tensors),
                                  values=len(want_values), nbytes=sum(t.numel() * t.element_size()
                                                                      for t in want_tensors.values()))


def test_safetensors_layout_is_aligned_and_streamed_through_a_small_buffer(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    calls: list[tuple[str, int, int]] = []
    export_checkpoint(saved, out, chunk_bytes=4096, progress=lambda *a: calls.append(a))
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 64 == 0
    header = json.loads(raw[8:8 + n])
    tensors = load_file(out)
    for key, entry in header.items():
        if key != "__metadata__":
            assert (8 + n + entry["data_offsets"][0]) % tensors[key].element_size() == 0, key
    done = [c[1] for c in calls]
    assert done == sorted(done) and calls[-1][1] == calls[-1][2] > 0 and {c[0] for c in calls} == {"copy"}


def test_export_reads_through_any_storage_backend(tmp_path: Path) -> None:
    url = "memory://interop-test/ck"
    zerostall.save_pytree(url, {"w": torch.arange(6.0), "n": 2}, options=THREAD)
    got = load_file(export_checkpoint(url, tmp_path / "m.safetensors").path)
    _same_tensor(torch.arange(6.0), got["w"])


def test_items_are_key_prefixes_and_item_selects_one(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    ck = tmp_path / "items"
    zerostall.save_checkpointables(ck, {"model": model, "extra": {"epoch": 3}, "rng": torch.arange(4)}, options=THREAD)
    everything = load_file(export_checkpoint(ck, tmp_path / "all.safetensors").path)
    assert sorted(everything) == ["model/bias", "model/weight", "rng"]
    with safe_open(tmp_path / "all.safetensors", "pt") as f:
        assert f.metadata()["extra/epoch"] == "3"
    only = load_file(export_checkpoint(ck, tmp_path / "model.safetensors", item="model").path)
    assert sorted(only) == ["bias", "weight"]
    _same_tensor(model.weight.detach(), only["weight"])
    leaf = load_file(export_checkpoint(ck, tmp_path / "rng.safetensors", item="rng").path)
    assert list(leaf) == ["rng"]  # a single value takes the item's name
    torch_all = torch.load(export_checkpoint(ck, tmp_path / "all.pt").path, weights_only=True)
    assert sorted(torch_all) == ["extra", "model", "rng"] and torch_all["extra"] == {"epoch": 3}
    with pytest.raises(MissingKeyError, match="no item 'optim'"):
        export_checkpoint(ck, tmp_path / "none.safetensors", item="optim")


def test_key_collision_is_an_error_naming_it_and_torch_keeps_both(tmp_path: Path) -> None:
    ck = tmp_path / "collide"
    zerostall.save_pytree(ck, {"d": {1: "int", "1": "str"}}, options=THREAD)
    with pytest.raises(UnsupportedLeafError, match="format='torch'") as exc:
        export_checkpoint(ck, tmp_path / "c.safetensors")
    assert exc.value.key in ("pytree/d/1",)
    assert _files(tmp_path) == ["collide"]
    got = torch.load(export_checkpoint(ck, tmp_path / "c.pt").path, weights_only=True)
    assert got == {"d": {1: "int", "1": "str"}}


def test_custom_leaves_export_encoded_to_safetensors_and_fail_clearly_for_torch(tmp_path: Path) -> None:
    zerostall.register_handler(datetime.date, name="date", format="json", encode=lambda d: d.isoformat(),
                               decode=datetime.date.fromisoformat)
    try:
        ck = tmp_path / "custom"
        zerostall.save_pytree(ck, {"day": datetime.date(2024, 5, 1), "w": torch.ones(1)}, options=THREAD)
        with safe_open(export_checkpoint(ck, tmp_path / "c.safetensors").path, "pt") as f:
            assert f.metadata()["day"] == '"2024-05-01"'
        with pytest.raises(UnsupportedLeafError, match="weights_only") as exc:
            export_checkpoint(ck, tmp_path / "c.pt")
        assert exc.value.key == "day"
        assert not (tmp_path / "c.pt").exists()
    finally:
        zerostall.unregister_handler(datetime.date)


def test_complex128_has_no_safetensors_dtype(tmp_path: Path) -> None:
    ck = tmp_path / "c128"
    zerostall.save_pytree(ck, {"z": torch.ones(2, dtype=torch.complex128)}, options=THREAD)
    with pytest.raises(UnsupportedLeafError, match="C128") as exc:
        export_checkpoint(ck, tmp_path / "z.safetensors")
    assert exc.value.key == "pytree/z"
    _same(torch.load(export_checkpoint(ck, tmp_path / "z.pt").path, weights_only=True)["z"], torch.ones(2, dtype=torch.complex128))


# -- export: torch ---------------------------------------------------------------------------------


def test_torch_export_loads_with_weights_only_bit_for_bit(saved: Path, tmp_path: Path) -> None:
    report = export_checkpoint(saved, tmp_path / "all.pt")
    got = torch.load(tmp_path / "all.pt", weights_only=True)
    _same(_state(), got)
    assert got["nested"]["pair"].__class__ is tuple  # namedtuples become tuples
    assert got["np_scalar"].shape == () and got["np_scalar"].dtype == torch.float32
    assert (report.format, report.tensors, report.values) == ("torch", len(DTYPES) + 8, 13)


# -- export: failures leave nothing --------------------------------------------------------------


def _corrupt(ckpt: Path, key: str) -> None:
    """Flip one bit of ``key``'s first byte in its data file."""
    m = read_manifest(open_storage(str(ckpt.parent)), ckpt.name, path=str(ckpt))
    leaf = next(lf for lf in m.leaves if lf.key == key)
    with open(ckpt / m.files[leaf.file].path, "r+b") as f:
        f.seek(leaf.offset)
        first = f.read(1)[0]
        f.seek(leaf.offset)
        f.write(bytes([first ^ 0x80]))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_corrupt_checkpoint_fails_naming_the_key_and_leaves_no_output(tmp_path: Path, suffix: str) -> None:
    ck = tmp_path / "ck"
    zerostall.save_pytree(ck, {"a": torch.arange(100.0), "b": torch.ones(3)}, options=THREAD)
    _corrupt(ck, "pytree/a")
    out = tmp_path / "out" / f"x{suffix}"
    out.parent.mkdir()
    with pytest.raises(ChecksumMismatchError) as exc:
        export_checkpoint(ck, out)
    assert exc.value.key == "pytree/a"
    assert _files(out.parent) == []  # no output, no temporary file


def test_truncated_data_file_is_corrupt(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    zerostall.save_pytree(ck, {"a": torch.arange(100.0)}, options=THREAD)
    data = next((ck / "data").iterdir())
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        export_checkpoint(ck, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_symlinked_data_file_is_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    zerostall.save_pytree(ck, {"a": torch.arange(4.0)}, options=THREAD)
    data = next((ck / "data").iterdir())
    os.replace(data, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", data)
    with pytest.raises(CorruptCheckpointError, match="is a symbolic link"):
        export_checkpoint(ck, tmp_path / "x.safetensors")


def test_existing_output_is_refused_unless_overwrite(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"precious")
    with pytest.raises(CheckpointExistsError):
        export_checkpoint(saved, out)
    assert out.read_bytes() == b"precious"
    export_checkpoint(saved, out, overwrite=True)
    assert "float32" in load_file(out)
    assert _files(tmp_path) == ["x.safetensors"]


def test_export_bad_inputs(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        export_checkpoint(tmp_path / "missing", tmp_path / "x.safetensors")
    with pytest.raises(UnsupportedFormatError, match="suffix"):
        export_checkpoint(saved, tmp_path / "x.dat")
    with pytest.raises(UnsupportedFormatError):
        export_checkpoint(saved, tmp_path / "x.dat", format="npz")  # type: ignore[arg-type]
    export_checkpoint(saved, tmp_path / "x.dat", format="torch")
    with pytest.raises(StorageError, match="does not exist") as exc:
        export_checkpoint(saved, tmp_path / "nodir" / "x.pt")
    assert exc.value.errno == errno.ENOENT


# -- sharded (a real 2-rank gloo save) ------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Rows sharded on dim 0, columns on dim 1, one replicated tensor: saved by two gloo ranks."""
    here = Path(__file__).parent.parent / "integration"
    sys.path.insert(0, str(here))
    import _dist_worker as worker

    d = tmp_path_factory.mktemp("sharded")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {k: v for k, v in os.environ.items() if k != "ZEROSTALL_FAULTS"}
    procs = [subprocess.Popen([sys.executable, str(here / "_dist_worker.py"), "dtensor_save", str(r), "2", str(port),
                               str(d)], env=env) for r in range(2)]
    for p in procs:
        assert p.wait(240) == 0
    for r in range(2):
        assert json.loads((d / f"result-{r}.json").read_text())["dtensor_save"]["ok"]
    return d / "dtensor_save" / "dt", worker._dtensor_globals()


def test_sharded_dtensors_are_assembled(sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    ck, full = sharded
    manifest = json.loads((ck / "manifest.json").read_text())
    assert len(manifest["files"]) == 2 and manifest["items"]["pytree"]["values"][0]["type"] == "sharded"
    got = load_file(export_checkpoint(ck, tmp_path / "dt.safetensors").path)
    assert sorted(got) == ["cols", "rep", "rows"]
    for k, v in full.items():
        _same_tensor(v, got[k])
    with safe_open(tmp_path / "dt.safetensors", "pt") as f:
        assert f.metadata()["rank"] == "0"  # rank 0's tree
    as_torch = torch.load(export_checkpoint(ck, tmp_path / "dt.pt").path, weights_only=True)
    _same({**full, "rank": 0}, as_torch)


# -- import ---------------------------------------------------------------------------------------


def _torch_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return {"model": model.state_dict(), "epoch": 3, "lr": 0.5, "hist": [torch.randn(2, generator=g), None],
            "bf16": torch.randn(5, generator=g).bfloat16(), "name": "run", "t": (1, torch.ones(2, dtype=torch.int8)),
            "view": torch.arange(10.0)[2:8:2]}


def test_import_torch_file_round_trips(tmp_path: Path) -> None:
    state = _torch_state()
    torch.save(state, tmp_path / "old.pt")
    report = import_checkpoint(tmp_path / "old.pt", tmp_path / "ck", options=THREAD)
    assert report == ImportReport(source=str(tmp_path / "old.pt"), path=str(tmp_path / "ck"), format="torch",
                                  tensors=8, nbytes=sum(t.numel() * t.element_size() for t in _flat(state).values()
                                                        if isinstance(t, torch.Tensor)))
    loaded = zerostall.load_pytree(tmp_path / "ck")
    _same({**state, "model": dict(state["model"])}, loaded)
    meta = json.loads((tmp_path / "ck" / "manifest.json").read_text())["metadata"]
    assert meta == {"imported_from": {"path": str(tmp_path / "old.pt"), "format": "torch"}}
    again = torch.load(export_checkpoint(tmp_path / "ck", tmp_path / "again.pt").path, weights_only=True)
    _same({**state, "model": dict(state["model"])}, again)


def test_import_legacy_torch_format(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    import_checkpoint(tmp_path / "legacy.pt", tmp_path / "ck", options=THREAD)
    _same({"w": torch.arange(3)}, zerostall.load_pytree(tmp_path / "ck"))


class NeedsPickle:
    pass


def test_import_refuses_files_that_need_pickle(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1), "obj": NeedsPickle()}, tmp_path / "evil.pt")
    with pytest.raises(UnsupportedFormatError, match="weights_only") as exc:
        import_checkpoint(tmp_path / "evil.pt", tmp_path / "ck", options=THREAD)
    assert "NeedsPickle" in str(exc.value) and exc.value.path == str(tmp_path / "evil.pt")
    assert not (tmp_path / "ck").exists()


def test_import_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        import_checkpoint(tmp_path / "missing.pt", tmp_path / "ck", options=THREAD)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file" * 10)
    with pytest.raises(UnsupportedFormatError, match="not a readable torch.save file"):
        import_checkpoint(tmp_path / "junk.pt", tmp_path / "ck", options=THREAD)
    (tmp_path / "dir").mkdir()
    with pytest.raises(UnsupportedFormatError, match="no .metadata"):
        import_checkpoint(tmp_path / "dir", tmp_path / "ck", options=THREAD)
    torch.save({"w": torch.ones(1)}, tmp_path / "ok.pt")
    import_checkpoint(tmp_path / "ok.pt", tmp_path / "ck", options=THREAD)
    with pytest.raises(CheckpointExistsError):
        import_checkpoint(tmp_path / "ok.pt", tmp_path / "ck", options=THREAD)
    torch.save({"dtype": torch.float32}, tmp_path / "dtype.pt")  # weights_only reads it; zerostall cannot save it
    with pytest.raises(UnsupportedLeafError) as exc:
        import_checkpoint(tmp_path / "dtype.pt", tmp_path / "ck2", options=THREAD)
    assert exc.value.key == "pytree/dtype"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_import_dcp_checkpoint_without_a_process_group(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    assert not torch.distributed.is_initialized()
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
             "optim": {"state": {0: {"exp_avg": torch.full((3,), 0.5)}}, "lr": 0.01}, "step": 7}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    report = import_checkpoint(tmp_path / "dcp", tmp_path / "ck", options=THREAD)
    assert report.format == "dcp" and report.tensors == 3
    got = zerostall.load_pytree(tmp_path / "ck")
    # DCP itself turns int dict keys into strings
    _same({"model": state["model"], "optim": {"state": {"0": {"exp_avg": torch.full((3,), 0.5)}}, "lr": 0.01},
           "step": 7}, got)


# -- import of a safetensors file (read by zerostall itself) ----------------------------------------


def _st_file(path: Path, header: dict[str, Any], data: bytes, pad_to: int = 8) -> Path:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % pad_to)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def test_import_of_a_safetensors_file_keeps_every_tensor_and_its_metadata(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"layers.0.weight": torch.randn(3, 5), "layers.0.bias": torch.randn(5).to(torch.bfloat16),
               "emb": torch.arange(12, dtype=torch.int64).reshape(2, 6), "mask": torch.tensor([True, False]),
               "empty": torch.zeros(0, 4), "f8": torch.randn(4).to(torch.float8_e4m3fn)}
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={"format": "pt", "note": "hi"})
    report = import_checkpoint(tmp_path / "m.safetensors", tmp_path / "ck")
    assert report.format == "safetensors" and report.tensors == len(tensors)
    got = zerostall.load_pytree(tmp_path / "ck")
    assert got.keys() == tensors.keys()
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(got[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k
    meta = zerostall.load_metadata(tmp_path / "ck")
    assert meta["safetensors_metadata"] == {"format": "pt", "note": "hi"}
    assert meta["imported_from"]["format"] == "safetensors"


def test_import_of_safetensors_needs_neither_pickle_nor_the_safetensors_package(tmp_path: Path) -> None:
    # torch 2.14 reads .safetensors through torch.load only with the package installed; zerostall
    # reads the format itself. An odd data offset (legal in the format) is read too.
    f32 = np.arange(6, dtype=np.float32).tobytes()
    _st_file(tmp_path / "odd.safetensors", {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                                            "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [1, 25]}},
             b"\x07" + f32)
    script = ("import sys; sys.modules['safetensors'] = None; import pickle; pickle.loads = None\n"
              "from zerostall.interop import import_checkpoint; import zerostall, torch\n"
              f"import_checkpoint({str(tmp_path / 'odd.safetensors')!r}, {str(tmp_path / 'ck')!r})\n"
              f"t = zerostall.load_pytree({str(tmp_path / 'ck')!r})\n"
              "assert t['a'].tolist() == [7] and t['w'].tolist() == [[0, 1, 2], [3, 4, 5]], t\nprint('ok')\n")
    src = os.path.join(os.path.dirname(zerostall.__file__), "..")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.path.abspath(src)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("make, why", [
    (lambda p: p.write_bytes(b"\x01\x02"), "shorter than the 8-byte header length"),
    (lambda p: p.write_bytes((10**9).to_bytes(8, "little") + b"{}"), "a header of 1000000000 bytes"),
    (lambda p: p.write_bytes((4).to_bytes(8, "little") + b"{no}"), "the header is not JSON"),
    (lambda p: _st_file(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
     "'w': its bytes 0..16 do not hold"),
    (lambda p: _st_file(p, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16),
     "'w': its bytes 0..16 do not hold"),
    (lambda p: _st_file(p, {"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
     "dtype 'Q4'"),
    (lambda p: _st_file(p, {"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0"),
     "no valid shape"),
    (lambda p: _st_file(p, {"__metadata__": {"a": 1}}, b""), "not a map of strings"),
    # two names over the same bytes, and bytes no name covers: the reference loader refuses both
    (lambda p: _st_file(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
     "'b' starts at byte 4 of the data, not at 8"),
    (lambda p: _st_file(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
     "'a' starts at byte 4 of the data, not at 0"),
    (lambda p: _st_file(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
     "the tensors cover 4 bytes of a data area of 8"),
])
def test_a_malformed_safetensors_file_is_refused_saying_what_is_wrong(tmp_path: Path, make: Any, why: str) -> None:
    p = tmp_path / "bad.safetensors"
    make(p)
    with pytest.raises(UnsupportedFormatError, match="not a readable safetensors file") as info:
        import_checkpoint(p, tmp_path / "ck")
    assert why in str(info.value) and info.value.path == str(p)
    assert not (tmp_path / "ck").exists()
