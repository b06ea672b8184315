"""zerostall.format: what writes the layout and what reads it back agree (one codec, one pattern each)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import zerostall
from zerostall.commit import RenameCommit, delete_checkpoint
from zerostall.format.header import (
    DATA_ALIGN,
    HeaderError,
    decode_header,
    encode_header,
    header_length,
    tensor_entries,
)
from zerostall.format.layout import ATTEMPT_RE, SOLO_ATTEMPT_RE, TAKEN_STEP_RE, parse_step, step_name
from zerostall.lease import host_id
from zerostall.restore import verify_checkpoint
from zerostall.stage.plan import make_plan
from zerostall.storage import open_storage
from zerostall.tree import flatten


def test_a_planned_data_file_header_reads_back_with_its_padding_entries_tiling_the_data() -> None:
    flat = flatten({"p": {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(5), "c": torch.zeros(0)}})
    f = make_plan(flat).files[0]
    n = header_length(f.header[:8], f.size)
    assert 8 + n == f.data_start and f.data_start % DATA_ALIGN == 0
    meta, entries = tensor_entries(decode_header(f.header[8:]), f.size - f.data_start)
    assert meta == {"format": "zerostall", "rank": "0"}
    by_name = {e.name: e for e in entries}
    assert by_name["p/b"].shape == (5,) and by_name["p/b"].lo % DATA_ALIGN == 0
    assert any(name.startswith("__zerostall_pad_") for name in by_name)  # the gap after the 3 bytes of "a"


@pytest.mark.parametrize("align", [1, 8, 64, 4096])
def test_an_encoded_header_starts_the_data_section_aligned_and_decodes_to_itself(align: int) -> None:
    header = {"__metadata__": {"k": "v"}, "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    head = encode_header(header, align=align)
    assert len(head) % align == 0
    assert decode_header(head[8:header_length(head[:8], len(head) + 8) + 8]) == header


@pytest.mark.parametrize("prefix, size, why", [
    (b"\x01\x02", 2, "shorter than the 8-byte header length"),
    ((10**9).to_bytes(8, "little"), 100, "a header of 1000000000 bytes in a file of 100"),
    ((1).to_bytes(8, "little"), 100, "a header of 1 bytes"),
])
def test_a_header_length_that_does_not_fit_the_file_is_refused(prefix: bytes, size: int, why: str) -> None:
    with pytest.raises(HeaderError, match=why):
        header_length(prefix, size)


def test_a_deeply_nested_header_is_a_header_error_not_a_recursion_error() -> None:
    with pytest.raises(HeaderError, match="not JSON"):
        decode_header(b"[" * 100_000 + b"]" * 100_000)


def test_verify_reports_a_data_file_whose_header_length_is_out_of_range(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    zerostall.save_pytree(str(ck), {"w": np.arange(6, dtype=np.float32)})
    data = ck / "data" / "rank-00000.safetensors"
    with open(data, "r+b") as f:
        f.write((10**9).to_bytes(8, "little"))
    report = verify_checkpoint(str(ck))
    header = [p for p in report.problems if p.kind == "header"]
    assert len(header) == 1 and header[0].file == "data/rank-00000.safetensors"
    assert "a header of 1000000000 bytes" in header[0].message


def test_the_attempt_patterns_read_back_the_writer_a_commit_names(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    attempt = RenameCommit(storage).begin(step_name(7))
    for pattern in (ATTEMPT_RE, SOLO_ATTEMPT_RE):
        m = pattern.match(attempt.staging)
        assert m is not None and m.group("host") == host_id() and int(m.group("pid")) == os.getpid()
    assert TAKEN_STEP_RE.match(attempt.staging) and int(TAKEN_STEP_RE.match(attempt.staging).group(1)) == 7


def test_a_deletion_directory_is_an_attempt_but_not_a_solo_save(tmp_path: Path) -> None:
    zerostall.save_pytree(str(tmp_path / step_name(3)), {"w": np.zeros(2)})
    storage = open_storage(str(tmp_path))
    storage.rename(step_name(3), f".{step_name(3)}.zs-del-{host_id()}-{os.getpid()}-0123456789ab")
    (name,) = storage.list("")
    assert ATTEMPT_RE.match(name) and not SOLO_ATTEMPT_RE.match(name)
    delete_checkpoint(storage, name)


def test_step_names_round_trip_and_other_names_are_no_steps() -> None:
    assert step_name(42) == "step_00000042" and parse_step(step_name(42)) == 42
    assert parse_step("step_") is None and parse_step(".step_00000001.zs-tmp-x") is None
