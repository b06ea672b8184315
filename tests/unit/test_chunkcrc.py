"""The writer's chunk-by-chunk checksums: the same CRC32C per leaf as one pass over the leaf."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from zerostall.checksum import checksum
from zerostall.messages import LeafRow
from zerostall.persist.chunkcrc import PIPELINE_ENV, ChunkChecksums, pipeline
from zerostall.storage.local import LocalStorage

MiB = 1 << 20


def _leaf(i: int, offset: int, nbytes: int, file: int = 0) -> LeafRow:
    return LeafRow(key=f"k{i}", kind="tensor", dtype="uint8", shape=(nbytes,), file=file, offset=offset,
                   nbytes=nbytes, shared=False)


def _buffer(n: int) -> memoryview:
    m = mmap.mmap(-1, n)
    m[:] = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes()
    return memoryview(m)


def test_leaves_split_across_chunks_get_their_whole_checksum(tmp_path: Path) -> None:
    n = 5 * MiB
    view = _buffer(n)
    # Leaves that start and end inside chunks, span several, and one of zero bytes; not in offset order.
    spans = [(3 * MiB + 5, MiB + 17), (0, 4096), (4096, 3 * MiB + 1), (3 * MiB + 1, 4), (4 * MiB + 100, 0),
             (4 * MiB + 22, n - 4 * MiB - 22)]
    leaves = [_leaf(i, o, k) for i, (o, k) in enumerate(spans)]
    mine = list(range(len(leaves)))
    sums = ChunkChecksums(leaves, mine, [view])
    LocalStorage(str(tmp_path)).write_from_buffer("f", view, n, threads=4, chunk_bytes=MiB, direct=True,
                                                  before_chunk=sums.hook(0))
    assert sums.finish() == [checksum(view[o:o + k]) for o, k in spans]
    assert (tmp_path / "f").read_bytes() == bytes(view[:n])


def test_a_chunk_offered_again_is_not_summed_twice() -> None:
    view = _buffer(2 * MiB)
    leaves = [_leaf(0, 0, 2 * MiB)]
    sums = ChunkChecksums(leaves, [0], [view])
    hook = sums.hook(0)
    hook(0, MiB)
    hook(0, MiB)  # after an O_DIRECT -> buffered fallback the write starts over
    hook(MiB, MiB)
    assert sums.finish() == [checksum(view)]


def test_a_leaf_no_chunk_covered_is_summed_at_finish() -> None:
    view = _buffer(MiB)
    sums = ChunkChecksums([_leaf(0, 0, MiB)], [0], [view])
    assert sums.finish() == [checksum(view)]


def test_pipeline_is_chosen_by_the_writers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PIPELINE_ENV, raising=False)
    assert pipeline() == "threads"
    monkeypatch.setenv(PIPELINE_ENV, "serial")
    assert pipeline() == "serial"


@pytest.mark.parametrize("mode", ["serial", "threads"])
def test_saved_checksums_match_with_small_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """End to end through a writer process (it inherits the pipeline): leaves cut by 1 MiB chunks
    load and verify, and a flipped byte is caught."""
    monkeypatch.setenv(PIPELINE_ENV, mode)
    import torch

    import zerostall

    tree = {"a": torch.randn(700, 1000), "b": torch.arange(10), "c": torch.randn(3, 5, 7), "e": torch.empty(0)}
    # A Checkpointer starts its own writer, which takes this environment (the free functions'
    # writer may already run with another).
    with zerostall.Checkpointer(tmp_path / "run", save_options=zerostall.SaveOptions(chunk_bytes=MiB)) as ck:
        ck.save_pytree(1, tree)
        back = ck.load_pytree(1)
        assert all(torch.equal(back[k], tree[k]) for k in tree)
        # Flip one byte inside the big leaf, past the first chunk: the load names the leaf.
        data = list((tmp_path / "run").rglob("*.safetensors"))
        assert len(data) == 1
        with open(data[0], "r+b") as f:
            f.seek(os.path.getsize(data[0]) - 1000)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(zerostall.ChecksumMismatchError, match="pytree/a"):
            ck.load_pytree(1)
