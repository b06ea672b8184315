"""One end of one transfer between two keepers over the group's gloo process group.

Each direction of a pair has its own tags, so a step each way may move at once. Every wait is
bounded by the group's timeout; a wait that fails (the peer died, closed, or went silent) marks
the link broken through the group's ``broken`` callback, which also keeps the tensors this link
posted alive (gloo may still write into or read from them) until the group closes.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from zerostall.buffers import HostBuffer
from zerostall.errors import ReplicaError
from zerostall.memtier.auth import Formation, Member, log, mac

__all__ = ["OK", "GroupEnd", "Link", "prove"]

OK, _REFUSED = 0, 1
_NONCE, _PROOF, _VERDICT = 1, 2, 3


class Link:
    """This keeper's end of a transfer with member ``peer`` (gloo rank ``rank``), ``src`` -> ``dst``."""

    def __init__(self, torch: Any, pg: Any, rank: int, *, peer: int, src: int, dst: int, host: str,
                 timeout_s: float, broken: Callable[[Link, str], ReplicaError]) -> None:
        self.torch, self.pg, self.rank = torch, pg, rank
        self.peer, self.src, self.dst = peer, src, dst
        self.sending = peer == dst
        self.timeout = timedelta(seconds=timeout_s)
        self.broken = broken
        self.base = (1 << 30) if src > dst else 0
        self.who = f"member {peer} on host {host!r}"
        #: tensors over memory this link handed to gloo: kept alive by the group after a failure
        self.live: list[Any] = []

    def wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:  # gloo: the connection closed, or the timeout passed
            raise self.broken(self, f"{what} with {self.who} failed: {exc}") from exc

    def send(self, t: Any, tag: int) -> Any:
        self.live.append(t)
        try:
            return self.pg.send([t], self.rank, self.base + tag)
        except RuntimeError as exc:  # gloo refuses at once on a connection the peer closed
            raise self.broken(self, f"sending to {self.who} failed: {exc}") from exc

    def recv(self, t: Any, tag: int) -> Any:
        self.live.append(t)
        try:
            return self.pg.recv([t], self.rank, self.base + tag)
        except RuntimeError as exc:
            raise self.broken(self, f"receiving from {self.who} failed: {exc}") from exc

    def exchange(self, data: bytes, tag: int, what: str) -> bytes:
        """Send ``data`` and receive as many bytes from the peer."""
        out = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8)
        back = self.torch.empty(len(data), dtype=self.torch.uint8)
        sw, rw = self.send(out, tag), self.recv(back, tag)
        self.wait(sw, what)
        self.wait(rw, what)
        return bytes(back.numpy())

    def code(self, value: int | None, tag: int, what: str) -> int:
        """Send ``value``, or (None) receive one: a verdict."""
        t = self.torch.tensor([0 if value is None else value], dtype=self.torch.int64)
        self.wait(self.recv(t, tag) if value is None else self.send(t, tag), what)
        return int(t.item())


def prove(link: Link, key: bytes, group_id: str) -> tuple[bytes, bytes]:
    """Prove the link both ways before any step byte: fresh nonces, then each end's HMAC over the
    group, both member ids, its role and both nonces, then each end's verdict on the other's.
    Returns ``(receiver's nonce, sender's nonce)``; raises :class:`ReplicaError` (and logs a
    WARNING naming the peer) when either end's proof fails."""
    mine = secrets.token_bytes(32)
    theirs = link.exchange(mine, _NONCE, "the nonce exchange")
    nr, ns = (theirs, mine) if link.sending else (mine, theirs)

    def proof(role: bytes) -> bytes:
        return mac(key, b"link", group_id.encode(), role, str(link.src).encode(), str(link.dst).encode(), nr, ns)

    mine_role, their_role = (b"S", b"R") if link.sending else (b"R", b"S")
    got = link.exchange(proof(mine_role), _PROOF, "the link proof")
    ok = hmac.compare_digest(got, proof(their_role))
    verdict = link.exchange(bytes([OK if ok else _REFUSED]), _VERDICT, "the link verdict")
    if not ok:
        log.warning("zerostall replica group: refused %s: its link proof does not verify", link.who)
        raise link.broken(link, f"{link.who} did not prove the link: nothing was "
                                f"{'sent' if link.sending else 'accepted'}")
    if verdict[0] != OK:
        raise link.broken(link, f"{link.who} refused this keeper's link proof")
    return nr, ns


class GroupEnd:
    """What a keeper group's end holds and how it is dropped, shared by the replica and parity
    transports: the proven formation, the gloo process group, the threads its transfers use, and
    what failed transfers keep alive (gloo may still touch it) until :meth:`close`."""

    formation: Formation
    _pg: Any
    _threads: ThreadPoolExecutor
    _kept: list[Any]

    @property
    def members(self) -> dict[int, Member]:
        return self.formation.members

    @property
    def refused(self) -> dict[int, str]:
        return self.formation.refused

    def close(self) -> None:
        """Drop the transport; then free what failed transfers kept alive."""
        self._threads.shutdown(wait=True)
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
        del pg
        for b in self._kept:
            if isinstance(b, HostBuffer):
                b.close()
        self._kept = []
