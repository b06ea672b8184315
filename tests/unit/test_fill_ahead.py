"""A cold pass's reader (``restore.read._FillAhead``): pieces filled front to back, one call per
run of neighbouring pieces, errors handed to the piece they hit, and a real cold load that reads
its data file through one descriptor."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.measure import drop_cache

import zerostall
from zerostall import LoadOptions, SaveOptions, WriterKind
from zerostall.restore import read as restore_read
from zerostall.storage.local import LocalStorage

MiB = 1 << 20


class Fill:
    """A fill function that reports every ``piece`` bytes, as ``LocalStorage.fill_cache`` does,
    recording its calls; it fails with EIO at ``fail_at`` (a file offset) if given."""

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.reported: list[int] = []
        self.fail_at, self.gate = fail_at, gate

    def __call__(self, key: str, offset: int, length: int, *, piece: int, on_filled: Any) -> None:
        self.calls.append((key, offset, length))
        for a in range(offset, offset + length, piece):
            end = min(a + piece, offset + length)
            if self.fail_at is not None and a <= self.fail_at < end:
                raise OSError(errno.EIO, "injected")
            if self.gate is not None:
                self.gate.wait()
            self.reported.append(end)
            on_filled(end)


def spans(*ranges: tuple[int, int, int]) -> list[tuple[int, str, int, int]]:
    return [(f, f"k{f}", a, b) for f, a, b in ranges]


def test_neighbouring_pieces_are_one_call_and_every_piece_is_reported() -> None:
    C = restore_read._FILL_CHUNK
    fill = Fill()
    pieces = spans((0, 0, C), (0, C, 2 * C), (0, 2 * C + 4096, 3 * C),  # a page of padding: same run
                   (0, 10 * C, 11 * C),  # far from the last: a run of its own
                   (1, 0, C))  # another file
    with restore_read._FillAhead(fill, pieces) as fa:
        assert fa is not None
        assert [fa.wait(k) for k in range(len(pieces))] == [None] * len(pieces)
    assert fill.calls == [("k0", 0, 3 * C), ("k0", 10 * C, C), ("k1", 0, C)]


def test_a_read_error_goes_to_the_piece_it_hit_and_the_rest_are_released() -> None:
    C = restore_read._FILL_CHUNK
    fill = Fill(fail_at=C + 5)
    pieces = spans((0, 0, C), (0, C, 2 * C), (0, 2 * C, 3 * C), (1, 0, C))
    with restore_read._FillAhead(fill, pieces) as fa:
        assert fa is not None
        got = [fa.wait(k) for k in range(len(pieces))]
    assert got[0] is None and isinstance(got[1], OSError) and got[1].errno == errno.EIO
    assert got[2] is None  # not filled: the pass reads it itself and reports its own error
    assert got[3] is None and ("k1", 0, C) in fill.calls  # the next file is still filled


def test_nothing_to_fill_enters_as_none() -> None:
    with restore_read._FillAhead(None, spans((0, 0, 10))) as fa:
        assert fa is None
    with restore_read._FillAhead(Fill(), []) as fa:
        assert fa is None


def test_the_reader_stops_when_the_pass_ends() -> None:
    C = restore_read._FILL_CHUNK
    gate = threading.Event()
    fill = Fill(gate=gate)
    pieces = spans(*[(0, k * C, (k + 1) * C) for k in range(50)])
    fa_outer = restore_read._FillAhead(fill, pieces)
    fa = fa_outer.__enter__()
    assert fa is not None
    timer = threading.Timer(0.05, gate.set)  # exit first, then let the blocked fill go on
    timer.start()
    fa_outer.__exit__(None, None, None)  # joins the reader: it read one more piece at most
    assert len(fill.reported) <= 1


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_a_cold_load_reads_its_file_front_to_back_on_one_descriptor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    atomic: bool) -> None:
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(MiB + 1000 * i, generator=g) for i in range(10)}  # about 40 MiB
    path = tmp_path / "ck"
    zerostall.save_pytree(path, state, options=SaveOptions(writer=WriterKind.THREAD))
    drop_cache(path / "data")  # cold: the reader has every piece to fill
    calls: list[tuple[int, int, list[int]]] = []
    real = LocalStorage.fill_cache

    def spy(self: LocalStorage, key: str, offset: int, length: int, **kw: Any) -> None:
        reported: list[int] = []
        on_filled = kw.get("on_filled")
        if on_filled is not None:
            kw["on_filled"] = lambda pos: (reported.append(pos), on_filled(pos))
        calls.append((offset, length, reported))
        real(self, key, offset, length, **kw)

    monkeypatch.setattr(LocalStorage, "fill_cache", spy)
    tmpl = {k: torch.zeros_like(v) for k, v in state.items()}
    zerostall.load_pytree(path, tmpl, options=LoadOptions(atomic=atomic))
    assert all(torch.equal(tmpl[k], v) for k, v in state.items())
    assert len(calls) == 1  # one reader, one descriptor, the whole range
    offset, length, reported = calls[0]
    assert length >= sum(v.numel() * 4 for v in state.values())
    assert reported == sorted(reported) and reported[-1] == offset + length and len(reported) >= 4
