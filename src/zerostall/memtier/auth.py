"""Membership of a job's keeper group, proven with the job's secret and never sending it.

Every keeper of a job is given the same per-job secret (bytes) at construction. Keys derive from
it and the job id (:func:`job_key`), so a keeper of another job fails even with the same secret.
Forming a group (:func:`form`) goes through a ``torch.distributed`` store in two rounds:

1. each member puts its *claim* under its member id, first writer wins (``compare_set``): job id,
   member id, host id, uid, boot id (which kernel), pid and a fresh 32-byte nonce;
2. once all ``size`` claims are there, each member puts its *proof*: an HMAC-SHA256, keyed with
   the job key, of the whole transcript (every claim, so every nonce) and its member id.

Each member then judges every other one from what the store holds: a claim of another job, a
proof that does not verify (wrong or no secret), or a member on this machine (same boot id, so
uids mean the same user) that runs as another uid is *refused*: logged at WARNING naming its
member id and host, and left out of the group, so no byte is ever sent to it or taken from it.
Members holding the secret judge alike and so agree on the group; the store sees nonces and
MACs only. What is and is not proven: docs/design.md, "Replicas in another host's memory".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from zerostall.errors import ReplicaError

__all__ = ["Member", "Formation", "job_key", "mac", "boot_id", "form"]

log = logging.getLogger("zerostall")

_LABEL = b"zerostall-replica-v1\0"
#: the most bytes a claim may have (read from the store before anything is verified)
_MAX_CLAIM = 4096


def job_key(secret: bytes, job_id: str) -> bytes:
    """The key every MAC of job ``job_id`` uses: HMAC-SHA256 of the job id under the secret."""
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ReplicaError("the job secret must be bytes, at least 16 of them (e.g. secrets.token_bytes(32))")
    return hmac.new(secret, _LABEL + job_id.encode(), hashlib.sha256).digest()


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed (no two part lists give the same input)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def boot_id() -> str:
    """This kernel's boot id: two processes with the same one share a uid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Member:
    """A keeper as its claim describes it."""

    member: int
    host: str
    uid: int
    boot: str
    pid: int


@dataclass(frozen=True)
class Formation:
    """The outcome of :func:`form`: the members that proved membership (this one included)."""

    me: Member
    members: dict[int, Member]
    #: member id -> why it was refused
    refused: dict[int, str]
    #: names this formation (a hash of its transcript and members); part of every later MAC
    group_id: str


def _claim(job_id: str, me: Member, nonce: bytes) -> str:
    return json.dumps({"v": 1, "job": job_id, "member": me.member, "host": me.host, "uid": me.uid,
                       "boot": me.boot, "pid": me.pid, "nonce": nonce.hex()}, sort_keys=True)


def _parse_claim(raw: bytes, member: int) -> tuple[dict[str, Any], Member] | str:
    """The claim and its member, or why it is not a well-formed claim for ``member``."""
    if len(raw) > _MAX_CLAIM:
        return f"its claim is {len(raw)} bytes"
    try:
        d = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return "its claim is not JSON"
    if not isinstance(d, dict) or d.get("v") != 1:
        return "its claim is not a version 1 claim"
    types = {"job": str, "member": int, "host": str, "uid": int, "boot": str, "pid": int, "nonce": str}
    if any(type(d.get(k)) is not t for k, t in types.items()):
        return "its claim lacks a field"
    if d["member"] != member:
        return f"its claim names member {d['member']}"
    return d, Member(member=member, host=d["host"], uid=d["uid"], boot=d["boot"], pid=d["pid"])


def _wait(store: Any, keys: list[str], timeout_s: float, what: str, members: list[int]) -> None:
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistStoreError: the timeout, or the store went away
        missing = [m for m, k in zip(members, keys, strict=True) if not _has(store, k)]
        raise ReplicaError(f"the keeper group did not form within {timeout_s:g} s: no {what} from member(s) "
                           f"{missing} ({exc})") from exc


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def form(store: Any, *, job_id: str, key: bytes, member: int, size: int, host: str,
         timeout_s: float) -> Formation:
    """Join the group of ``size`` keepers of ``job_id`` through ``store`` (a prefixed store of
    this group's own; see the module's docstring). Raises :class:`ReplicaError` when a claim or
    proof is missing at ``timeout_s``, when this member's slot was claimed by another process,
    or when no other member proved membership."""
    me = Member(member=member, host=host, uid=os.getuid(), boot=boot_id(), pid=os.getpid())
    nonce = secrets.token_bytes(32)
    mine = _claim(job_id, me, nonce)
    got = store.compare_set(f"claim/{member}", "", mine)
    if got != mine.encode():
        raise ReplicaError(f"member {member}'s slot of keeper group {job_id!r} is claimed by another process "
                           f"({bytes(got)[:200]!r}); give each keeper its own member id")
    ids = list(range(size))
    _wait(store, [f"claim/{m}" for m in ids], timeout_s, "claim", ids)
    raws = [bytes(store.get(f"claim/{m}")) for m in ids]
    transcript = hashlib.sha256(b"".join(len(r).to_bytes(8, "little") + r for r in raws)).digest()
    store.compare_set(f"proof/{member}", "", mac(key, b"member", transcript, str(member).encode()).hex())
    _wait(store, [f"proof/{m}" for m in ids], timeout_s, "proof", ids)

    members: dict[int, Member] = {member: me}
    refused: dict[int, str] = {}
    for m, raw in zip(ids, raws, strict=True):
        if m == member:
            continue
        why = _judge(raw, m, job_id, key, transcript, bytes(store.get(f"proof/{m}")), me)
        if isinstance(why, Member):
            members[m] = why
        else:
            refused[m] = why
            host_of = _parse_claim(raw, m)
            where = host_of[1].host if isinstance(host_of, tuple) else "?"
            log.warning("zerostall replica group %r: refused member %d on host %r: %s", job_id, m, where, why)
    group_id = mac(key, b"group", transcript, ",".join(map(str, sorted(members))).encode()).hex()[:32]
    if len(members) == 1 and size > 1:
        raise ReplicaError(f"no other keeper of job {job_id!r} proved membership to member {member} on host "
                           f"{host!r} (refused: {refused}); is this keeper's secret the job's?")
    return Formation(me=me, members=members, refused=refused, group_id=group_id)


def _judge(raw: bytes, m: int, job_id: str, key: bytes, transcript: bytes, proof_hex: bytes,
           me: Member) -> Member | str:
    """Member ``m`` if it proved membership, else why not."""
    parsed = _parse_claim(raw, m)
    if isinstance(parsed, str):
        return parsed
    d, who = parsed
    if d["job"] != job_id:
        return f"it is a keeper of job {d['job'][:100]!r}"
    expect = mac(key, b"member", transcript, str(m).encode()).hex().encode()
    if not hmac.compare_digest(proof_hex, expect):
        return "its proof does not verify under this job's secret"
    if who.boot == me.boot and who.uid != me.uid:
        return f"it runs as uid {who.uid} on this machine, this keeper as uid {me.uid}"
    return who
