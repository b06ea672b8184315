"""The keepers' replication path (``memtier.peers``) with real gloo pairs in one process: a holder
keeps a step only from a keeper of the same job and secret, verified; the ranks' agreement
counts a memory step only when every rank's share is somewhere."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from zerostall.format.manifest import parse_manifest
from zerostall.memtier.messages import HeldReplica, ReplicaSetup
from zerostall.memtier.rebuild import PARITY
from zerostall.memtier.tier import plan_steps

torch = pytest.importorskip("torch")


def _saved(tmp_path: Path, first: float = 0.0) -> tuple[bytes, tuple[tuple[str, memoryview], ...]]:
    """A real step's manifest and data files (a save's, read back); ``first`` changes the bytes,
    not the layout."""
    import zerostall

    d = tmp_path / f"step-{first}"
    zerostall.save_pytree(str(d), {"w": torch.arange(first, first + 4096.0), "b": torch.ones(7)})
    manifest = (d / "manifest.json").read_bytes()
    files = tuple((f.path.rsplit("/", 1)[-1], memoryview(bytearray((d / f.path).read_bytes())))
                  for f in parse_manifest(manifest, path=str(d)).files)
    return manifest, files


def _setup(port: int, rank: int, job: str, secret: bytes, in_place: bool = False) -> ReplicaSetup:
    return ReplicaSetup(store=f"127.0.0.1:{port}", job=job, secret=secret.hex(), world=2, rank=rank,
                        ranks_per_host=1, replicas=1, timeout_s=10.0, in_place=in_place)


def _until(cond, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_holder_keeps_a_step_only_from_a_keeper_with_the_jobs_secret(tmp_path: Path) -> None:
    import torch.distributed as dist

    from zerostall.memtier.peers import Peers

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    manifest, files = _saved(tmp_path)
    sender, holder = Peers("inst"), Peers("inst")
    try:
        holder.configure(_setup(store.port, 1, "job-a", b"s" * 32))
        sender.configure(_setup(store.port, 0, "job-a", b"x" * 32))  # another secret
        assert sender.send(6, manifest, files) is False  # refused: nothing sent
        assert holder.held() == ()
        holder.configure(_setup(store.port, 1, "job-b", b"s" * 32))
        sender.configure(_setup(store.port, 0, "job-b", b"s" * 32))  # the job's secret
        assert sender.send(6, manifest, files) is True
        assert _until(lambda: holder.held() == (HeldReplica(origin=0, step=6),))
        kept: list[bytes] = []
        holder.with_replica(0, lambda r: kept.extend(bytes(r.view(i)) for i in range(len(r.names))) if r else None)
        assert kept == [bytes(v) for _, v in files]  # bit for bit
    finally:
        sender.close()
        holder.close()


def test_a_pair_forms_its_group_once_and_sends_every_later_step_over_it(tmp_path: Path) -> None:
    """A group costs a store rendezvous and gloo's connections: the pair forms one at its first
    offer and keeps it; each later step costs its bytes and a handshake only."""
    import torch.distributed as dist

    from zerostall.memtier.peers import Peers

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    manifest, files = _saved(tmp_path)
    sender, holder = Peers("inst"), Peers("inst")
    try:
        holder.configure(_setup(store.port, 1, "job", b"s" * 32))
        sender.configure(_setup(store.port, 0, "job", b"s" * 32))
        for step in (6, 7, 8):
            holder.configure(_setup(store.port, 1, "job", b"s" * 32))  # told again after each Hello: no change
            sender.configure(_setup(store.port, 0, "job", b"s" * 32))
            assert sender.send(step, manifest, files) is True
            assert _until(lambda step=step: holder.held() == (HeldReplica(origin=0, step=step),))  # type: ignore[misc]
        jobs = dist.PrefixStore("zerostall-replicas/job", store)
        formed = [g for g in (1, 2, 3) if jobs.check([f"zerostall-replica/pair/0-1/{g}/claim/0"])]
        assert formed == [1]  # offers 2 and 3 went over offer 1's group
        kept: list[bytes] = []
        holder.with_replica(0, lambda r: kept.extend(bytes(r.view(i)) for i in range(len(r.names))) if r else None)
        assert kept == [bytes(v) for _, v in files]
    finally:
        sender.close()
        holder.close()


def test_a_holder_receives_each_step_into_the_buffers_of_the_replica_it_replaced(tmp_path: Path) -> None:
    """Fresh memory per step costs a keeper more CPU (faults, zeroing, freeing) than the transfer:
    step 8 lands in step 6's buffers, bit for bit, while step 7 stays whole. A replica whose
    descriptors were lent to another process is never received into again."""
    import os

    import torch.distributed as dist

    from zerostall.memtier.peers import Peers

    def inodes(r) -> list[int]:  # type: ignore[no-untyped-def]
        return [os.fstat(b.fd).st_ino for b in r.buffers]

    def content(holder: Peers) -> tuple[list[bytes], list[int]]:
        got: list[tuple[list[bytes], list[int]]] = []
        holder.with_replica(0, lambda r: got.append(([bytes(r.view(i)) for i in range(len(r.names))], inodes(r))))
        return got[0]

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    a, b = _saved(tmp_path), _saved(tmp_path, 1.0)  # the same layout, other bytes
    sender, holder = Peers("inst"), Peers("inst")
    try:
        holder.configure(_setup(store.port, 1, "job", b"s" * 32))
        sender.configure(_setup(store.port, 0, "job", b"s" * 32))
        seen: dict[int, tuple[list[bytes], list[int]]] = {}
        for step, (manifest, data) in ((6, a), (7, b), (8, a), (9, b)):
            assert sender.send(step, manifest, data) is True
            assert _until(lambda step=step: holder.held() == (HeldReplica(origin=0, step=step),))  # type: ignore[misc]
            seen[step] = content(holder)
            assert seen[step][0] == [bytes(v) for _, v in data]  # never a stale byte of the older step
        assert seen[8][1] == seen[6][1] and seen[9][1] == seen[7][1]  # received into the replaced buffers
        assert seen[7][1] != seen[6][1]
        lent: list[tuple[int, int]] = []  # step 9's descriptors go to a trainer, as a restore's
        holder.with_replica(0, lambda r: lent.extend((os.dup(b.fd), n) for b, n in zip(r.buffers, r.lengths)),
                            lend=True)
        try:
            for step in (10, 11):
                assert sender.send(step, *a) is True
                assert _until(lambda step=step: holder.held() == (HeldReplica(origin=0, step=step),))  # type: ignore[misc]
                assert content(holder)[0] == [bytes(v) for _, v in a[1]]
            assert [os.pread(fd, n, 0) for fd, n in lent] == [bytes(v) for _, v in b[1]]  # untouched
        finally:
            for fd, _ in lent:
                os.close(fd)
    finally:
        sender.close()
        holder.close()


def test_in_place_a_holder_keeps_one_copy_and_has_no_replica_while_one_arrives_or_after_one_failed(
        tmp_path: Path) -> None:
    """``replicas_in_place``: every step lands in the buffers of the one it replaces (one copy held,
    the default keeps two once a second step arrived); the held replica is given up when the next
    transfer starts, so a transfer that fails leaves none (never a mix of two steps)."""
    import os

    import torch.distributed as dist

    from zerostall.memtier.peers import Peers

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    a, b = _saved(tmp_path), _saved(tmp_path, 1.0)  # the same layout, other bytes
    one = sum(len(v) for _, v in a[1])
    sender, holder, twice = Peers("inst"), Peers("inst"), Peers("inst")
    try:
        holder.configure(_setup(store.port, 1, "job", b"s" * 32, in_place=True))
        sender.configure(_setup(store.port, 0, "job", b"s" * 32))
        inodes: list[list[int]] = []
        for step, (manifest, data) in ((6, a), (7, b), (8, a)):
            assert sender.send(step, manifest, data) is True
            assert _until(lambda step=step: holder.held() == (HeldReplica(origin=0, step=step),))  # type: ignore[misc]
            got: list[tuple[list[bytes], list[int]]] = []
            holder.with_replica(0, lambda r: got.append(([bytes(r.view(i)) for i in range(len(r.names))],
                                                         [os.fstat(x.fd).st_ino for x in r.buffers])))
            assert got[0][0] == [bytes(v) for _, v in data]
            inodes.append(got[0][1])
            assert one <= holder.held_bytes() < 2 * one  # one copy (its buffers are page-rounded)
        assert inodes[0] == inodes[1] == inodes[2]  # every step received into the same buffers
        # a transfer that fails (the manifest promises bytes the sender does not have) leaves no replica
        bad = tuple((name, v[: len(v) // 2]) for name, v in a[1])
        assert sender.send(9, a[0], bad) is False
        assert _until(lambda: holder.held() == ())
        assert holder.held_bytes() < one  # nothing half-received is held as a replica
    finally:
        sender.close()
        holder.close()
    sender = Peers("inst")
    try:  # the default, for contrast: the replaced replica's buffers are kept to receive the next into
        twice.configure(_setup(store.port, 1, "job-2", b"s" * 32))
        sender.configure(_setup(store.port, 0, "job-2", b"s" * 32))
        for step, (manifest, data) in ((6, a), (7, b)):
            assert sender.send(step, manifest, data) is True
            assert _until(lambda step=step: twice.held() == (HeldReplica(origin=0, step=step),))  # type: ignore[misc]
        assert twice.held_bytes() >= 2 * one
    finally:
        sender.close()
        twice.close()


def test_a_receiver_waiting_for_an_offer_ends_when_its_keeper_stops() -> None:
    """The receiver blocks in a store wait (no polling, no timed wake-ups to log); a stop puts a
    marker under the key it waits on, so closing or re-configuring never leaves it behind."""
    import threading

    import torch.distributed as dist

    from zerostall.memtier.peers import Peers

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    holder = Peers("inst")

    def receivers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("zerostall-keeper-replicas-")
                and not t.name.endswith("-stop")]

    before = set(receivers())
    holder.configure(_setup(store.port, 1, "job-a", b"s" * 32))
    mine = [t for t in receivers() if t not in before]
    assert len(mine) == 1
    time.sleep(0.5)  # in its store wait by now
    holder.configure(_setup(store.port, 1, "job-b", b"s" * 32))  # a new job: the old receiver ends
    mine[0].join(10)
    assert not mine[0].is_alive()
    newer = [t for t in receivers() if t not in before and t is not mine[0]]
    assert len(newer) == 1
    time.sleep(0.5)
    holder.close()
    newer[0].join(10)
    assert not newer[0].is_alive()


def test_a_memory_step_counts_only_when_every_ranks_share_is_held_somewhere() -> None:
    # Host B (ranks 2, 3) lost; host A's keepers hold their own step 6 and B's replicas of it.
    assert plan_steps([([4], 6, {2: 6}, None), ([4], 6, {3: 6}, None), ([4], None, {}, None),
                       ([4], None, {}, None)]) == ([4], {6: [[0], [1], [0], [1]]})
    # Rank 3's replica is of an older step: step 6 is not complete anywhere, step 5 neither.
    assert plan_steps([([4], 6, {2: 6}, None), ([4], 6, {3: 5}, None), ([4], None, {}, None),
                       ([4], None, {}, None)]) == ([4], {})
    # Every rank holds its own step: no replica needed; storage common steps only.
    assert plan_steps([([2, 4], 6, {1: 6}, None), ([4], 6, {0: 6}, None)]) == ([4], {6: [[0, 1], [1, 0]]})


def test_a_lost_member_is_rebuilt_only_from_a_group_whose_others_hold_the_step_and_its_parity() -> None:
    groups = [[0, 2], [1, 3]]  # two hosts of two ranks; each group is one local index
    lost_b = [([4], 6, {}, 6), ([4], 6, {}, 6), ([4], None, {}, None), ([4], None, {}, None)]
    assert plan_steps(lost_b, groups) == ([4], {6: [[0], [1], [PARITY], [PARITY]]})
    assert plan_steps(lost_b) == ([4], {})  # without parity groups nothing rebuilds them
    # Rank 1's parity is of the step before (its exchange of step 6 had not ended): rank 3 is lost.
    assert plan_steps([([4], 6, {}, 6), ([4], 6, {}, 5), ([4], None, {}, None), ([4], None, {}, None)],
                      groups) == ([4], {})
    # Two members of one group lost: one parity cannot rebuild both.
    assert plan_steps([([4], 6, {}, 6), ([4], None, {}, None), ([4], None, {}, None)], [[0, 1, 2]]) == ([4], {})


def _pair(port: int) -> tuple[object, object]:
    """A sender (member 0) and a receiver (member 1) of one group, formed in two threads."""
    import threading

    import torch.distributed as dist

    from zerostall.memtier.replica import ReplicaGroup

    out: dict[int, object] = {}

    def join(member: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        out[member] = ReplicaGroup(store, job_id="job", secret=b"s" * 32, member=member, size=2, group="scatter",
                                   timeout_s=20, chunk_bytes=1 << 20)

    ts = [threading.Thread(target=join, args=(m,)) for m in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out[0], out[1]


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "a_changed_byte"])
def test_a_share_is_received_straight_into_the_loads_templates_and_verified(tmp_path: Path, corrupt: bool) -> None:
    """A rank on a new host receives its share into the templates' memory (whole pieces) and
    through a small buffer (a file's header, small leaves), verified leaf by leaf: the load then
    only assembles. A changed byte fails the transfer, naming its leaf."""
    import threading

    import torch.distributed as dist

    import zerostall
    from zerostall.errors import ReplicaError
    from zerostall.memtier.replica import OutgoingStep, ReplicaOf
    from zerostall.memtier.tier import _LoadInto
    from zerostall.restore.load import assemble

    state = {"w": torch.arange(3 << 18, dtype=torch.float32), "b": torch.arange(7.0), "n": torch.ones(3, 5),
             "step": 12}
    d = tmp_path / "step"
    zerostall.save_pytree(str(d), state)
    manifest = (d / "manifest.json").read_bytes()
    files = tuple((f.path.rsplit("/", 1)[-1], memoryview(bytearray((d / f.path).read_bytes())))
                  for f in parse_manifest(manifest, path=str(d)).files)
    if corrupt:
        files[0][1][-5] ^= 0x40  # inside the last leaf's bytes
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    sender, receiver = _pair(store.port)
    template = {"w": torch.zeros(3 << 18), "b": torch.zeros(7), "n": torch.zeros(3, 5), "step": 0}
    w_memory = template["w"].data_ptr()
    into = _LoadInto({"pytree": template}, None, str(d))
    sent: list[BaseException] = []

    def send() -> None:
        try:
            sender.send_step(1, OutgoingStep(of=ReplicaOf("inst", 2, 0, 12), manifest=manifest, files=files))  # type: ignore[attr-defined]
        except BaseException as exc:  # checked below
            sent.append(exc)

    t = threading.Thread(target=send)
    t.start()
    try:
        if corrupt:
            with pytest.raises(ReplicaError, match="differ from the CRC32C") as err:
                receiver.recv_step(0, run_id="inst", world=2, rank=0, step=12, into=into)  # type: ignore[attr-defined]
            assert err.value.key is not None
        else:
            got = receiver.recv_step(0, run_id="inst", world=2, rank=0, step=12, into=into)  # type: ignore[attr-defined]
            assert got.scattered and got.buffers == []
            assert got.in_place_bytes >= 2 << 20  # the big leaf's whole pieces; the rest went through a buffer
            assert into.thunks is not None
            out = assemble(into.thunks, str(d))["pytree"]
            assert out["w"].data_ptr() == w_memory  # loaded in place, not into a copy
            for k in ("w", "b", "n"):
                assert torch.equal(out[k], state[k]), k
            assert out["step"] == 12
    finally:
        t.join(30)
        sender.close()  # type: ignore[attr-defined]
        receiver.close()  # type: ignore[attr-defined]
    assert bool(sent) == corrupt  # the sender hears the receiver's verdict


def test_a_share_goes_to_memfds_where_the_load_must_not_write_the_templates_early(tmp_path: Path) -> None:
    """Receiving into the templates is planned like a load from storage: only for an
    ``atomic=False`` load (the default) of templates that match the share. An all-or-nothing load,
    or a template the share does not fit (its load raises, naming the key), receives into memfds."""
    import zerostall
    from zerostall.memtier.tier import _LoadInto
    from zerostall.options import LoadOptions

    d = tmp_path / "step"
    zerostall.save_pytree(str(d), {"w": torch.arange(4096.0), "b": torch.ones(7)})
    man = parse_manifest((d / "manifest.json").read_bytes(), path=str(d))

    def into(template: object, options: LoadOptions | None = None) -> _LoadInto:
        return _LoadInto({"pytree": template}, options, str(d))

    fits = {"w": torch.zeros(4096), "b": torch.zeros(7)}
    scatter = into(fits)(man)
    assert scatter is not None
    regions = [r for regs in scatter.regions for r in regs]
    assert sorted(end - start for start, end, _ in regions) == [7 * 4, 4096 * 4]  # one per leaf, its bytes
    assert into(fits, LoadOptions(atomic=True))(man) is None
    assert into({"w": torch.zeros(4095), "b": torch.zeros(7)})(man) is None
    assert into(None)(man) is not None  # no template: fresh arrays, planned as a load plans them
