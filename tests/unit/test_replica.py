"""Replica placement (never on the original's host) and the membership proof of a keeper group,
formed here by threads through one in-process store (the transport between processes is
tests/integration/test_replica_transport.py)."""

from __future__ import annotations

import itertools
import logging
import threading

import pytest
import torch.distributed as dist

from zerostall.errors import InvalidArgumentError, ReplicaError
from zerostall.memtier.auth import Formation, form, job_key, mac
from zerostall.memtier.placement import replica_holders, replica_origins

SECRET = b"s" * 32


@pytest.mark.parametrize("world,per_host", [(8, 4), (12, 4), (10, 4), (9, 6), (6, 1), (16, 8), (7, 3)])
def test_replicas_are_never_on_the_original_s_host_and_each_on_its_own(world, per_host) -> None:
    hosts = -(-world // per_host)
    for replicas, rank in itertools.product(range(hosts), range(world)):
        got = replica_holders(rank, world, per_host, replicas)
        assert len(got) == replicas
        on = [r // per_host for r in got]
        assert rank // per_host not in on
        assert len(set(on)) == replicas


def test_placement_goes_ranks_per_host_along() -> None:
    assert replica_holders(0, 8, 4, 1) == [4]
    assert replica_holders(6, 8, 4, 1) == [2]
    assert replica_holders(5, 12, 4, 2) == [9, 1]
    assert replica_holders(3, 8, 4, 0) == []


def test_one_host_cannot_hold_a_replica() -> None:
    with pytest.raises(InvalidArgumentError, match="need 2 hosts") as e:
        replica_holders(0, 4, 4, 1)
    assert e.value.argument == "replicas"
    with pytest.raises(InvalidArgumentError, match="need 3 hosts"):
        replica_holders(0, 8, 4, 2)
    with pytest.raises(InvalidArgumentError, match="outside the world"):
        replica_holders(8, 8, 4, 1)


def test_origins_are_the_inverse_of_holders() -> None:
    world, per_host, replicas = 12, 4, 2
    for holder in range(world):
        for origin in replica_origins(holder, world, per_host, replicas):
            assert holder in replica_holders(origin, world, per_host, replicas)
    assert sum(len(replica_origins(h, world, per_host, replicas)) for h in range(world)) == world * replicas


def test_the_mac_of_parts_is_not_the_mac_of_their_concatenation() -> None:
    k = job_key(SECRET, "job")
    assert mac(k, b"ab", b"c") != mac(k, b"a", b"bc")
    assert job_key(SECRET, "job") != job_key(SECRET, "job2")
    with pytest.raises(ReplicaError, match="at least 16"):
        job_key(b"short", "job")


def _form_all(members: list[tuple[bytes, str]], timeout_s: float = 20.0) -> list[Formation | ReplicaError]:
    store = dist.HashStore()
    out: list[Formation | ReplicaError] = [ReplicaError("not run")] * len(members)

    def one(i: int) -> None:
        secret, job = members[i]
        try:
            out[i] = form(store, job_id=job, key=job_key(secret, job), member=i, size=len(members),
                          host=f"host-{i}", timeout_s=timeout_s)
        except ReplicaError as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_members_with_the_secret_agree_and_refuse_the_one_without(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="zerostall"):
        a, b, c, x = _form_all([(SECRET, "job"), (SECRET, "job"), (SECRET, "job"), (b"x" * 32, "job")])
    assert isinstance(a, Formation) and isinstance(b, Formation) and isinstance(c, Formation)
    assert sorted(a.members) == sorted(b.members) == sorted(c.members) == [0, 1, 2]
    assert a.group_id == b.group_id == c.group_id
    assert set(a.refused) == {3} and "does not verify" in a.refused[3]
    assert isinstance(x, ReplicaError) and "proved membership" in str(x)
    assert "refused member 3 on host 'host-3'" in caplog.text


def test_a_keeper_of_another_job_is_refused_even_with_the_secret() -> None:
    a, b, other = _form_all([(SECRET, "job"), (SECRET, "job"), (SECRET, "job-b")])
    assert isinstance(a, Formation) and isinstance(b, Formation)
    assert "keeper of job 'job-b'" in a.refused[2]
    assert isinstance(other, ReplicaError)


def test_a_member_that_never_comes_is_an_error_naming_it_at_the_timeout() -> None:
    store = dist.HashStore()
    with pytest.raises(ReplicaError, match=r"no claim from member\(s\) \[1\]"):
        form(store, job_id="job", key=job_key(SECRET, "job"), member=0, size=2, host="h", timeout_s=0.5)


def test_a_taken_member_slot_is_an_error() -> None:
    store = dist.HashStore()
    store.set("claim/0", "someone else's claim")
    with pytest.raises(ReplicaError, match="claimed by another process"):
        form(store, job_id="job", key=job_key(SECRET, "job"), member=0, size=2, host="h", timeout_s=0.5)
