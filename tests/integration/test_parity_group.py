"""The parity transport (``memtier.paritygroup``) with real gloo groups in one process, members as
threads: an exchange leaves each member the parity ``parity.encode`` computes; any one member's
share is rebuilt bit for bit into the process taking its place, and a wrong byte anywhere, a
silent member, a wrong secret or a second loss is a ReplicaError, never a result."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zerostall.checksum import checksum
from zerostall.errors import ReplicaError
from zerostall.format.manifest import encode_manifest, parse_manifest
from zerostall.memtier.parity import ParityLayout, encode
from zerostall.memtier.replica import ReplicaOf

torch = pytest.importorskip("torch")

SECRET = b"s" * 32
PIECE = 64 << 10  # the smallest piece: each chunk goes in several


def _saved(tmp_path: Path, m: int) -> tuple[bytes, list[memoryview]]:
    """Member ``m``'s step as a save writes it, read back: several leaves, a size of its own."""
    import zerostall

    d = tmp_path / f"member-{m}"
    zerostall.save_pytree(str(d), {"w": torch.arange(float(m), m + 30000.0 + 7001 * m), "b": torch.ones(7 + m),
                                   "n": torch.full((3, 5 + m), float(m)), "step": 12})
    manifest = (d / "manifest.json").read_bytes()
    return manifest, [memoryview(bytearray((d / f.path).read_bytes()))
                      for f in parse_manifest(manifest, path=str(d)).files]


def _two_files(seed: int) -> tuple[bytes, list[memoryview]]:
    """A share of two data files (a keeper's staging may write several), leaves across both."""
    rng = np.random.default_rng(seed)
    sizes = [90_001, 40_003]
    bufs = [memoryview(bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())) for n in sizes]
    leaves = []
    for fi, (b, n) in enumerate(zip(bufs, sizes, strict=True)):
        cuts = [0, 1000, 70_000 if n > 70_000 else n - 3, n]
        for i, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
            leaves.append({"key": f"f{fi}/leaf{i}", "kind": "bytes", "dtype": "U8", "shape": [hi - lo], "file": fi,
                           "offset": lo, "nbytes": hi - lo, "crc32c": checksum(b[lo:hi])})
    items = {lf["key"]: {"type": "bytes", "leaf": i} for i, lf in enumerate(leaves)}
    files = [{"path": f"data/file{fi}", "size": n} for fi, n in enumerate(sizes)]
    return encode_manifest(items=items, leaves=leaves, files=files), bufs


def _shares(tmp_path: Path, g: int) -> list[tuple[bytes, list[memoryview]]]:
    """Sizes differ between members; with 3 members one share is empty, with 4 one has two files."""
    out = [_saved(tmp_path, m) for m in range(g)]
    if g == 3:
        out[2] = (encode_manifest(items={}, leaves=[], files=[]), [])
    if g == 4:
        out[1] = _two_files(1)
    return out


def _together(calls: dict[int, Callable[[], Any]]) -> dict[int, Any]:
    """Each call on a thread of its own; its result, or the exception it raised."""
    out: dict[int, Any] = {}

    def run(k: int, f: Callable[[], Any]) -> None:
        try:
            out[k] = f()
        except BaseException as exc:  # checked by the caller
            out[k] = exc

    ts = [threading.Thread(target=run, args=kf) for kf in calls.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return out


def _form(port: int, g: int, generation: int, *, timeout_s: float = 20.0,
          secrets: dict[int, bytes] | None = None) -> dict[int, Any]:
    import torch.distributed as dist

    from zerostall.memtier.paritygroup import ParityGroup

    def join(m: int) -> ParityGroup:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        return ParityGroup(store, job_id="job", secret=(secrets or {}).get(m, SECRET), member=m, size=g,
                           generation=generation, timeout_s=timeout_s, chunk_bytes=PIECE)

    return _together({m: lambda m=m: join(m) for m in range(g)})  # type: ignore[misc]


def _close(groups: dict[int, Any]) -> None:
    for grp in groups.values():
        if not isinstance(grp, BaseException):
            grp.close()


@pytest.fixture
def store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))


def _exchange(groups: dict[int, Any], shares: list[tuple[bytes, list[memoryview]]], step: int) -> dict[int, Any]:
    return _together({m: lambda m=m: groups[m].exchange(step, *shares[m]) for m in groups})  # type: ignore[misc]


def _rebuild(port: int, held: dict[int, Any], shares: list[tuple[bytes, list[memoryview]]], lost: int,
             generation: int) -> dict[int, Any]:
    """The survivors and the process taking ``lost``'s place form a new group and rebuild."""
    g = len(shares)
    groups = _form(port, g, generation)
    alive = [m for m in range(g) if m != lost]
    try:
        calls: dict[int, Callable[[], Any]] = {
            m: lambda m=m: groups[m].rebuild(held[m], lost, shares[m][1], alive=alive) for m in alive}  # type: ignore[misc]
        calls[lost] = lambda: groups[lost].receive_rebuilt(ReplicaOf("run", g, lost, 5), alive=alive)
        return _together(calls)
    finally:
        _close(groups)


@pytest.mark.parametrize("g", [2, 3, 4])
def test_each_member_holds_its_stripes_parity_and_any_one_share_is_rebuilt_bit_for_bit(
        tmp_path: Path, store: Any, g: int) -> None:
    shares = _shares(tmp_path, g)
    groups = _form(store.port, g, 0)
    try:
        held = _exchange(groups, shares, 5)
    finally:
        _close(groups)
    layout = ParityLayout(tuple(sum(len(v) for v in s[1]) for s in shares), g)
    assert len(set(layout.sizes)) == g  # every member's size its own
    for m in range(g):
        assert not isinstance(held[m], BaseException), held[m]
        assert held[m].step == 5 and held[m].layout == layout
        assert held[m].manifests == tuple(man for man, _ in shares)
        want = bytearray(layout.chunk)
        encode(layout, m, {k: shares[k][1] for k in range(g) if k != m}, memoryview(want))
        assert bytes(held[m].view()) == bytes(want)
    for lost in range(g):
        got = _rebuild(store.port, held, shares, lost, 1 + lost)
        for m in range(g):
            assert not isinstance(got[m], BaseException), (lost, m, got[m])
        step = got[lost]
        try:
            assert step.of == ReplicaOf("run", g, lost, 5) and step.manifest == shares[lost][0]
            assert [bytes(step.view(i)) for i in range(len(step.names))] == [bytes(v) for v in shares[lost][1]]
            assert step.lengths == [len(v) for v in shares[lost][1]]
        finally:
            step.close()
    groups = _form(store.port, g, g + 1)  # the next step's parity forms in this one's buffer
    try:
        spares = {m: held[m].parity for m in range(g)}
        for b in spares.values():
            np.frombuffer(b.view, dtype=np.uint8)[:] = 0xAA  # a stale byte would show
        nxt = _together({m: lambda m=m: groups[m].exchange(6, *shares[m], spare=spares[m])  # type: ignore[misc]
                         for m in range(g)})
    finally:
        _close(groups)
    for m in range(g):
        assert not isinstance(nxt[m], BaseException), nxt[m]
        assert nxt[m].step == 6 and nxt[m].parity is spares[m]
        want = bytearray(layout.chunk)
        encode(layout, m, {k: shares[k][1] for k in range(g) if k != m}, memoryview(want))
        assert bytes(nxt[m].view()) == bytes(want)
        nxt[m].close()


def _leaf_at(manifest: bytes, pos: int) -> str:
    """The key of the leaf holding byte ``pos`` of a share (its files read as one)."""
    man = parse_manifest(manifest, path="x")
    starts = np.cumsum([0] + [f.size for f in man.files])
    for lf in man.leaves:
        a = int(starts[lf.file]) + lf.offset
        if a <= pos < a + lf.nbytes:
            return lf.key
    raise AssertionError(f"byte {pos} is in no leaf")


@pytest.mark.parametrize("where", ["parity", "survivor_share"])
def test_a_wrong_parity_or_survivor_byte_fails_the_rebuild_naming_its_leaf(tmp_path: Path, store: Any,
                                                                           where: str) -> None:
    shares = _shares(tmp_path, 4)
    groups = _form(store.port, 4, 0)
    try:
        held = _exchange(groups, shares, 5)
    finally:
        _close(groups)
    lost, holder, other = 2, 0, 3  # lost's chunk j(2, 0) = its bytes [0, c); member 3's chunk 0 goes in too
    pos = 40_000  # inside lost's big leaf and inside member 3's real bytes of that chunk
    assert pos < held[0].layout.chunk
    if where == "parity":
        held[holder].parity.view[pos] ^= 0x10
    else:
        shares[other][1][0][pos] ^= 0x10
    got = _rebuild(store.port, held, shares, lost, 1)
    key = _leaf_at(shares[lost][0], pos)
    for m in range(4):
        assert isinstance(got[m], ReplicaError), (m, got[m])  # the new member and every survivor: no result
        assert got[m].key == key, (m, got[m])
    assert "differ from the CRC32C" in str(got[lost])
    for h in held.values():
        h.close()


def test_a_member_that_never_exchanges_fails_the_others_exchange_naming_it(tmp_path: Path, store: Any) -> None:
    shares = _shares(tmp_path, 3)
    groups = _form(store.port, 3, 0, timeout_s=2.0)
    try:
        got = _together({m: lambda m=m: groups[m].exchange(5, *shares[m]) for m in (0, 1)})  # type: ignore[misc]
    finally:
        _close(groups)
    for m in (0, 1):
        assert isinstance(got[m], ReplicaError), got[m]
        assert "member 2" in str(got[m]) and "step 5" in str(got[m])


def test_members_exchanging_different_steps_all_refuse(tmp_path: Path, store: Any) -> None:
    shares = _shares(tmp_path, 3)
    groups = _form(store.port, 3, 0)
    try:
        got = _together({m: lambda m=m: groups[m].exchange(5 if m == 0 else 6, *shares[m])  # type: ignore[misc]
                         for m in range(3)})
    finally:
        _close(groups)
    for m in range(3):
        assert isinstance(got[m], ReplicaError), got[m]
    assert "expected step 5's exchange" in str(got[0])


def test_a_member_with_another_secret_is_refused_and_the_group_cannot_exchange(tmp_path: Path,
                                                                               store: Any) -> None:
    shares = _shares(tmp_path, 3)
    groups = _form(store.port, 3, 0, secrets={2: b"x" * 32})
    try:
        assert isinstance(groups[2], ReplicaError)  # nobody accepted it
        for m in (0, 1):
            assert sorted(groups[m].members) == [0, 1] and 2 in groups[m].refused
            with pytest.raises(ReplicaError, match=r"member\(s\) \[2\] are not in it"):
                groups[m].exchange(5, *shares[m])
    finally:
        _close(groups)


def test_two_members_lost_is_an_error_at_once(tmp_path: Path, store: Any) -> None:
    shares = _shares(tmp_path, 3)
    groups = _form(store.port, 3, 0)
    try:
        held = _exchange(groups, shares, 5)
        with pytest.raises(ReplicaError, match=r"member\(s\) \[2\] are gone too"):
            groups[0].rebuild(held[0], 1, shares[0][1], alive=[0])
        with pytest.raises(ReplicaError, match=r"member\(s\) \[2\] are gone too"):
            groups[1].receive_rebuilt(ReplicaOf("run", 3, 1, 5), alive=[0])
    finally:
        _close(groups)
    for h in held.values():
        h.close()
