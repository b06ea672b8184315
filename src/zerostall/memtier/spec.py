"""The memory tier's keeper as the trainer finds it: its name, its spec, adopting it, asking it.

A keeper is named after the user, the checkpoint directory and the rank (:func:`keeper_address`,
an abstract unix socket); :class:`KeeperSpec` is what its trainer starts it with. A new trainer
adopts a lingering keeper (:func:`adopt`), ``zerostall list`` asks what the keepers of a
directory hold (:func:`held_steps`), and both ends check the other's user (``SO_PEERCRED``).
The keeper process itself is :mod:`zerostall.memtier.keeper`; this module is what the writer's
client and the tools need of it, with no part of the writer.
"""


from __future__ import annotations

import hashlib
import os
import socket
import struct
from dataclasses import dataclass
from multiprocessing.connection import Connection

from zerostall.errors import (
    InvalidArgumentError,
    ZerostallError,
)
from zerostall.lease import HOST_ENV
from zerostall.memtier.instance import read_instance
from zerostall.memtier.messages import Adopt, Image, ImageQuery, KeeperBusy
from zerostall.messages import Hello, decode, encode
from zerostall.storage import local_path, open_storage

__all__ = ["KeeperSpec", "keeper_address", "adopt", "peer_credentials", "query_held", "held_steps",
           "ADDRESS_PREFIX", "busy_error", "directory_replaced", "root_key", "pid_running", "peer_pid", "name_holder",
           "who", "silence", "HELLO_TIMEOUT_S"]

ADDRESS_PREFIX = b"\0zerostall-keeper-"
#: how long a new trainer waits for a keeper that accepted it to hand over (the persist after a
#: crash runs beside the new session and does not delay it)
ADOPT_TIMEOUT_S = 600.0
HELLO_TIMEOUT_S = 10.0


def root_key(root: str) -> str:
    local = local_path(root)
    return os.path.realpath(local) if local is not None else root


def directory_replaced(root: str, instance: str) -> bool:
    """Whether the directory at ``root`` is no longer the instance ``instance`` (deleted, or
    deleted and created again: its marker is missing or names another instance). False when
    ``instance`` is empty (unknown) or storage cannot be read now (gone is never guessed)."""
    if not instance:
        return False
    try:
        return read_instance(open_storage(root)) != instance
    except Exception:  # noqa: BLE001 - unreadable now is not gone
        return False


def keeper_address(root: str, rank: int, uid: int | None = None) -> bytes:
    """The abstract socket name of the keeper of ``(user, directory, rank)`` on this host.

    With ``ZEROSTALL_HOST_ID`` set, the host id is part of the name: the keepers of one host
    are invisible to the processes of another (several hosts simulated on one machine, or
    containers sharing a network namespace), which reach them only through the replica
    transport (:mod:`zerostall.memtier.replica`). Unset, the name is the machine's.
    """
    uid = os.getuid() if uid is None else uid
    host = os.environ.get(HOST_ENV)
    digest = hashlib.sha256((f"{uid}\0{root_key(root)}\0{rank}" + (f"\0{host}" if host else "")).encode())
    return ADDRESS_PREFIX + digest.hexdigest()[:32].encode()


@dataclass(frozen=True)
class KeeperSpec:
    """Which keeper a trainer's writer is: the Checkpointer's directory and rank, and its linger."""

    root: str
    rank: int
    linger_s: float
    #: the directory's instance id (:mod:`zerostall.memtier.instance`; empty: unknown, a read-only
    #: trainer of a directory without a marker): the keeper's steps belong to that instance only
    instance: str = ""

    @property
    def address(self) -> bytes:
        return keeper_address(self.root, self.rank)

    def argv(self) -> list[str]:
        """The writer's extra command-line arguments that make it this keeper."""
        return [self.address.hex(), repr(float(self.linger_s)), self.root, str(self.rank), self.instance]

    @staticmethod
    def from_argv(args: list[str]) -> tuple[bytes, KeeperSpec]:
        return bytes.fromhex(args[0]), KeeperSpec(root=args[2], rank=int(args[3]), linger_s=float(args[1]),
                                                  instance=args[4] if len(args) > 4 else "")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a unix socket (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _connect(address: bytes) -> socket.socket | None:
    """A connection to the keeper at ``address`` run by this user, or None."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        return None
    _, uid, _ = peer_credentials(sock)
    if uid != os.getuid():  # another user holds the name: never talk to it
        sock.close()
        return None
    return sock


def adopt(spec: KeeperSpec, timeout_s: float = ADOPT_TIMEOUT_S) -> tuple[Connection, Hello] | None:
    """Claim the lingering keeper of ``spec``: the connection (its writer from now on) and its Hello.

    None when there is no keeper, it belongs to another user, it speaks another protocol, or it
    holds the steps of another instance of the directory (deleted since: that keeper gives up
    its name before it closes the connection, and exits); the caller then starts a writer of
    its own.

    Raises:
        InvalidArgumentError: the keeper serves a live trainer (this process or another): two
            memory tiers of one directory and rank on one host would lose steps silently.
    """
    sock = _connect(spec.address)
    if sock is None:
        return None
    conn = Connection(sock.detach())
    try:
        conn.send_bytes(encode(Adopt(root=spec.root, rank=spec.rank, instance=spec.instance)))
        if not conn.poll(timeout_s):
            conn.close()
            return None
        msg = decode(conn.recv_bytes())
    except (EOFError, OSError, ZerostallError):
        conn.close()
        return None
    if isinstance(msg, KeeperBusy):
        conn.close()
        raise busy_error(spec, msg)
    if not isinstance(msg, Hello):
        conn.close()
        return None
    return conn, msg


def busy_error(spec: KeeperSpec, busy: KeeperBusy) -> InvalidArgumentError:
    """The error a trainer raises when the memory tier of ``spec`` is held by another trainer's keeper
    (its keeper's :class:`KeeperBusy`, or the refusal of a keeper it tried to adopt)."""
    if busy.pid_is_keeper:
        who = (f"by another keeper (pid {busy.pid}) that serves no live trainer now; retry to adopt it"
               if busy.pid > 0 else "by another keeper (pid unknown)")
    else:
        who = f"by a live trainer (pid {busy.pid}{', this process' if busy.pid == os.getpid() else ''})"
    return InvalidArgumentError(
        f"{spec.root}: the memory tier of this directory and rank {spec.rank} is already held on this host "
        f"{who}; a second Checkpointer with a memory tier of the same directory and rank would keep steps no "
        "restart could find. Close the first one, or give this one another directory", path=spec.root)


def query_held(root: str, rank: int) -> Image | None:
    """The step the keeper of ``(root, rank)`` holds, without claiming it (for ``zerostall list``).

    None when no keeper of this user answers.
    """
    sock = _connect(keeper_address(root, rank))
    if sock is None:
        return None
    conn = Connection(sock.detach())
    try:
        conn.send_bytes(encode(ImageQuery()))
        if not conn.poll(HELLO_TIMEOUT_S):
            return None
        msg = decode(conn.recv_bytes())
    except (EOFError, OSError, ZerostallError):
        return None
    finally:
        conn.close()
    return msg if isinstance(msg, Image) else None


def _listening_keepers() -> set[bytes]:
    """The abstract names of the keepers listening on this host (any user's)."""
    names: set[bytes] = set()
    try:
        with open("/proc/net/unix") as f:
            for line in f:
                parts = line.split()
                if parts and parts[-1].startswith("@zerostall-keeper-"):
                    names.add(b"\0" + parts[-1][1:].encode())
    except OSError:
        pass
    return names


def held_steps(root: str, max_rank: int = 4096) -> list[tuple[int, Image]]:
    """``(rank, image)`` of every keeper of this user and ``root`` on this host that holds a step."""
    names = _listening_keepers()
    out: list[tuple[int, Image]] = []
    if not names:
        return out
    replaced: dict[str, bool] = {}  # a keeper of a deleted instance of the directory holds nothing of it
    for rank in range(max_rank):
        if keeper_address(root, rank) in names:
            img = query_held(root, rank)
            if img is None or img.step is None:
                continue
            if img.instance not in replaced:
                replaced[img.instance] = directory_replaced(root, img.instance)
            if not replaced[img.instance]:
                out.append((rank, img))
    return out


def pid_running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: its sockets are already closed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def peer_pid(conn: Connection) -> int:
    """The pid of the process at the other end of ``conn`` (a unix socket)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        pid, _, _ = peer_credentials(sock)
    finally:
        sock.close()
    return pid


def name_holder(address: bytes) -> KeeperBusy | str | None:
    """Who holds the keeper name ``address``: a keeper of this user (as the :class:`KeeperBusy`
    its trainer should hear: the live trainer it serves, else the keeper itself), ``"other"``
    (another user's process), or None (nobody accepts a connection: gone, or not listening yet).
    A look (:class:`ImageQuery`), never a claim."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        pid, uid, _ = peer_credentials(sock)
    except OSError:
        sock.close()
        return None
    if uid != os.getuid():
        sock.close()
        return "other"
    conn = Connection(sock.detach())
    try:
        conn.send_bytes(encode(ImageQuery()))
        msg = decode(conn.recv_bytes()) if conn.poll(HELLO_TIMEOUT_S) else None
    except (EOFError, OSError, ZerostallError):
        msg = None
    finally:
        conn.close()
    if isinstance(msg, Image) and msg.trainer_pid is not None:
        return KeeperBusy(pid=msg.trainer_pid)
    return KeeperBusy(pid=pid, pid_is_keeper=True)


def who(address: bytes) -> str:
    """``"pid P, uid U"`` of the process listening on ``address`` (as far as it can be told)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        pid, uid, _ = peer_credentials(sock)
    except OSError:
        return "gone since"
    finally:
        sock.close()
    return f"pid {pid}, uid {uid}"


def silence(fd: int) -> None:
    """Point ``fd`` at /dev/null (releasing the pipe or terminal it had)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    os.dup2(null, fd)
    os.close(null)
