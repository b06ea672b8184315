"""Several "hosts" on one machine, made of Linux namespaces, for the multi-host tests.

A test that needs N machines (a trainer per host, keepers that must not see each other's shared
memory, a host whose network fails) gets them here as namespaces on this one machine (needs root):

* each host has its own network namespace with ``lo`` and an ``eth0`` joined by a veth pair to a
  Linux bridge that lives in one more namespace (the "switch"); addresses come from the
  benchmarking range 198.18.0.0/15 (RFC 2544), one /24 per instance, and nothing is ever added to
  the root namespace, so no packet of a test can reach any other address;
* each host has its own persistent mount and UTS namespaces: private tmpfs on ``/dev/shm`` and
  ``/tmp``, its own hostname (the host's name) and an ``/etc/hosts`` naming every host of the
  instance, so ``gethostbyname(gethostname())`` gives the host's routable address, which is how
  gloo and torch.distributed pick their interface. Every process started in a host shares that
  host's ``/dev/shm``, ``/tmp`` and hostname; processes of different hosts do not;
* the ``shared`` paths (typically the test's ``tmp_path``) are visible read-write at the same path
  in every host: the "shared filesystem" that checkpoint storage lives on; so are this checkout
  and the running interpreter's environment when they lie under ``/tmp`` or ``/dev/shm`` (a clone
  in /tmp), which the private tmpfs would otherwise hide from every process started in a host;
* ``cut`` and ``restore`` take a host's switch port down and up: a network failure without netem;
  a SIGSTOPped process is a hung peer (its kernel still completes connects, it answers nothing).

Not separated: the PID namespace (``ps`` in a host lists every process of the machine), users,
and /sys, which stays the root's (/sys/class/net lists the root's interfaces; a fresh sysfs would
hide /sys/fs/cgroup): code that finds its interfaces by getifaddrs or by resolving the hostname,
as gloo does, sees the host's own.

``close`` (or leaving the ``with`` block, also by an exception) kills every process in the hosts by
namespace membership, deletes the namespaces and unmounts and removes everything it made (all but
the directory /run/zerostall-nshosts and its lock file, which every instance shares). A new instance
also removes what instances of dead processes left behind (a SIGKILLed pytest).

tests/conftest.py puts tests/support on ``sys.path``, so tests import it as ``nshosts``; the
``nshosts`` fixture of tests/integration/conftest.py makes instances and closes them at teardown.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["Hosts", "NamespacesUnavailable", "SUBNET", "ROOT", "PREFIX", "remove_stale"]

#: every address a Hosts instance gives out lies in this range (RFC 2544 benchmarking, never routed)
SUBNET = "198.18.0.0/15"
#: one /24 of SUBNET per live instance: 198.18.0.0/24 .. 198.19.255.0/24
_SLOTS = 512
#: the per-instance directories (private bind mounts holding the namespace files and /etc/hosts)
ROOT = Path("/run/zerostall-nshosts")
#: every namespace and directory name starts with PREFIX-<creator pid>-<slot>
PREFIX = "zsh"
_NETNS_DIR = Path("/run/netns")  # where `ip netns` keeps its namespace files
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a DNS label: a valid hostname
_INSTANCE_RE = re.compile(rf"^{PREFIX}-(\d+)-(\d+)$")
_NETNS_RE = re.compile(rf"^({PREFIX}-\d+-\d+)(-[a-z0-9-]+|\.br)$")
_COMMAND_TIMEOUT_S = 30.0  # one ip/mount/unshare call: milliseconds, unless the machine is wedged
_KILL_TIMEOUT_S = 15.0  # SIGKILLed processes leave at once unless in uninterruptible sleep
_LOCK_TIMEOUT_S = 60.0  # other instances hold the lock only while they pick a slot
_TOOLS = ("ip", "bridge", "unshare", "nsenter", "mount", "umount", "env")

# Runs inside a new host's mount and UTS namespaces (and its network namespace), as
# ``python -I -c _SETUP CONFIG``: sets the hostname, keeps the shared paths through the private
# tmpfs on /tmp and /dev/shm, binds /etc/hosts, and drops this namespace's copies of other
# namespaces' handles (see _drop_handles).
_SETUP = r"""
import json, os, re, socket, subprocess, sys

cfg = json.loads(sys.argv[1])

def sh(*argv):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        sys.exit(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")

socket.sethostname(cfg["hostname"])
# The shared paths usually live under /tmp, which the tmpfs below hides: bind each to a staging
# directory first, then bind that back at its own path on top of the new tmpfs.
stages = []
for i, path in enumerate(cfg["shared"]):
    stage = os.path.join(cfg["stage"], str(i))
    os.makedirs(stage, exist_ok=True)
    sh("mount", "--rbind", path, stage)
    stages.append((stage, path))
for target in ("/tmp", "/dev/shm"):
    sh("mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", target)
for stage, path in stages:
    os.makedirs(path, exist_ok=True)
    sh("mount", "--rbind", stage, path)
sh("mount", "--bind", cfg["hosts_file"], "/etc/hosts")

# This namespace began as a copy of the root's mounts, so it holds copies of every netns file in
# /run/netns and every mount namespace file of earlier instances and hosts: those copies would keep
# those namespaces (and their veths) alive until this one dies. Detach them here.
def unescape(s):
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)

targets = []
with open("/proc/self/mountinfo") as f:
    for line in f:
        t = unescape(line.split()[4])
        if any(t == d or t.startswith(d + "/") for d in cfg["drop"]):
            targets.append(t)
for t in targets:
    if not any(t.startswith(o + "/") for o in targets):  # a lazy unmount takes its submounts along
        sh("umount", "--lazy", t)
"""


class NamespacesUnavailable(RuntimeError):
    """The namespaces could not be made (not root, a tool missing, a kernel without veth or bridge
    support); the message names the failing command and its stderr."""


def _run(argv: Sequence[str], *, input: str | None = None) -> str:
    """Run one setup command; its stdout. NamespacesUnavailable naming the command and stderr."""
    try:
        p = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NamespacesUnavailable(f"{' '.join(argv)}: {e}") from e
    if p.returncode != 0:
        raise NamespacesUnavailable(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def _ns_id(path: Path | str) -> tuple[int, int] | None:
    """The identity (device, inode) of a namespace file, or None where it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _members(namespaces: set[tuple[int, int]]) -> list[int]:
    """Every process whose net, mount or UTS namespace is one of ``namespaces``. Zombies have no
    namespaces any more (their /proc/<pid>/ns links fail), so only live processes count."""
    if not namespaces:
        return []
    me = os.getpid()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        for kind in ("net", "mnt", "uts"):
            if _ns_id(f"/proc/{entry.name}/ns/{kind}") in namespaces:
                out.append(int(entry.name))
                break
    return out


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks since boot), which tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _is_mount(path: Path) -> bool:
    """Whether ``path`` is a mount point in this process's mount namespace."""
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialize slot choice and stale cleanup between processes (pytest-xdist, other engineers)."""
    try:
        ROOT.mkdir(mode=0o755, exist_ok=True)
        fd = os.open(ROOT / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise NamespacesUnavailable(f"cannot make {ROOT}/.lock (root is needed): {e}") from e
    try:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NamespacesUnavailable(f"{ROOT}/.lock held for over {_LOCK_TIMEOUT_S} s") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _teardown(instance: str, errors: list[str]) -> None:
    """Remove everything of ``instance`` (``PREFIX-<pid>-<slot>``): kill its processes, delete its
    network namespaces, unmount and remove its namespace files and directory. Carries on past a
    failing step (so that the rest is still removed) and appends what failed to ``errors``."""
    netns = [n for n in _listdir(_NETNS_DIR) if (m := _NETNS_RE.match(n)) and m.group(1) == instance]
    d = ROOT / instance
    ns_files = [d / n for n in _listdir(d) if n.endswith((".mnt", ".uts"))]
    namespaces = {i for p in [*(_NETNS_DIR / n for n in netns), *ns_files] if (i := _ns_id(p)) is not None}
    # Keepers and their trainers run in sessions of their own, so process groups do not find them
    # all; namespace membership does. Repeat: a process may fork while the first kills land.
    deadline = time.monotonic() + _KILL_TIMEOUT_S
    while pids := _members(namespaces):
        if time.monotonic() > deadline:
            errors.append(f"processes {pids} of {instance} did not die within {_KILL_TIMEOUT_S} s")
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    for n in netns:
        p = subprocess.run(["ip", "netns", "delete", n], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
        if p.returncode != 0:
            errors.append(f"ip netns delete {n}: {p.stderr.strip()}")
    for f in ns_files:
        p = subprocess.run(["umount", str(f)], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
        if p.returncode != 0 and "not mounted" not in p.stderr:
            errors.append(f"umount {f}: {p.stderr.strip()}")
    if d.exists():
        if _is_mount(d):
            p = subprocess.run(["umount", str(d)], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
            if p.returncode != 0:
                errors.append(f"umount {d}: {p.stderr.strip()}")
        try:
            shutil.rmtree(d)
        except OSError as e:
            errors.append(f"rm -r {d}: {e}")


def _listdir(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def _owner(instance: str) -> tuple[int, str | None]:
    """The creator's pid and start time recorded for ``instance`` (start time None: not recorded)."""
    pid = int(instance.split("-")[1])
    try:
        return pid, (ROOT / instance / "owner").read_text().split()[1]
    except (OSError, IndexError):
        return pid, None


def remove_stale() -> list[str]:
    """Remove the instances whose creating process is gone (killed before it could close them);
    the instance names removed. Every new Hosts does this first."""
    with _locked():
        return _remove_stale()


def _remove_stale() -> list[str]:
    # Under _locked(): two processes removing the same leftovers would trip over each other.
    instances = {m.group(1) for n in _listdir(_NETNS_DIR) if (m := _NETNS_RE.match(n))}
    instances |= {n for n in _listdir(ROOT) if _INSTANCE_RE.match(n)}
    removed = []
    for inst in sorted(instances):
        pid, started = _owner(inst)
        alive = _start_time(pid)
        # A live pid with another start time is a reused pid: its creator is gone too.
        if alive is None or (started is not None and alive != started):
            errors: list[str] = []
            _teardown(inst, errors)
            if errors:
                raise NamespacesUnavailable(f"cannot remove the leftovers of {inst}: {'; '.join(errors)}")
            removed.append(inst)
    return removed


def _hidden_by_private_tmp() -> list[Path]:
    """This checkout and the interpreter's environments, where a host's private ``/tmp`` or
    ``/dev/shm`` would hide them (the processes started in it import zerostall and its tests from there)."""
    out = []
    for p in (Path(__file__).resolve().parents[2], Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()):
        if any(Path(t) in p.parents for t in ("/tmp", "/dev/shm")) and p.is_dir():
            out.append(p)
    return out


def _outermost(paths: Sequence[Path]) -> tuple[Path, ...]:
    """``paths`` without repeats and without those inside another: each is bound once."""
    uniq = sorted(set(paths), key=lambda p: (len(p.parts), str(p)))
    return tuple(p for i, p in enumerate(uniq) if not any(q in p.parents for q in uniq[:i]))


class Hosts:
    """N hosts made of namespaces; see the module docstring. Use as a context manager, or call
    :meth:`close`, which also runs when the ``with`` block raises.

    ``names`` are the hostnames (DNS labels, distinct); ``shared`` the paths every host sees
    read-write at the same place (they must exist).
    """

    def __init__(self, names: Sequence[str], *, shared: Sequence[Path | str] = ()) -> None:
        self.names: tuple[str, ...] = tuple(names)
        if not self.names or len(set(self.names)) != len(self.names) or len(self.names) > 250:
            raise ValueError(f"need 1 to 250 distinct host names, got {self.names}")
        for n in self.names:
            if not _NAME_RE.match(n):
                raise ValueError(f"host name {n!r} is not a DNS label (a-z, 0-9, -)")
        given = [Path(p).resolve() for p in shared]
        for p in given:
            if not p.is_dir():
                raise ValueError(f"shared path {p} is not a directory")
        self.shared: tuple[Path, ...] = _outermost([*given, *_hidden_by_private_tmp()])
        missing = [t for t in _TOOLS if shutil.which(t) is None]
        if missing:
            raise NamespacesUnavailable(f"not on PATH: {', '.join(missing)}")
        if os.geteuid() != 0:
            raise NamespacesUnavailable(f"namespaces need root; euid is {os.geteuid()}")
        self._closed = False
        self._procs: list[subprocess.Popen[Any]] = []
        self.instance = ""
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        with _locked():
            _remove_stale()
            used = {int(m.group(1).split("-")[2]) for n in _listdir(_NETNS_DIR) if (m := _NETNS_RE.match(n))}
            used |= {int(m.group(2)) for n in _listdir(ROOT) if (m := _INSTANCE_RE.match(n))}
            free = [k for k in range(_SLOTS) if k not in used]
            if not free:
                raise NamespacesUnavailable(f"all {_SLOTS} subnets of {SUBNET} are in use by live instances")
            self.slot = free[0]
            self.instance = f"{PREFIX}-{os.getpid()}-{self.slot}"
            self.dir = ROOT / self.instance
            self.dir.mkdir()
            (self.dir / "owner").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        # unshare --mount=FILE needs FILE on a mount of private propagation (else the bind would
        # propagate into the very namespace it names): bind the directory onto itself, private.
        _run(["mount", "--bind", str(self.dir), str(self.dir)])
        _run(["mount", "--make-private", str(self.dir)])
        net = f"198.{18 + self.slot // 256}.{self.slot % 256}"
        self._addr = {n: f"{net}.{i + 1}" for i, n in enumerate(self.names)}
        self._mac = {n: f"02:7a:{self.slot // 256:02x}:{self.slot % 256:02x}:00:{i + 1:02x}"
                     for i, n in enumerate(self.names)}
        self._port = {n: f"vb{i}" for i, n in enumerate(self.names)}
        hosts_file = self.dir / "hosts"
        hosts_file.write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
                              + "".join(f"{a} {n}\n" for n, a in self._addr.items()))
        hosts_file.chmod(0o644)
        self.bridge_netns = f"{self.instance}.br"
        _run(["ip", "netns", "add", self.bridge_netns])
        _run(["ip", "-n", self.bridge_netns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_netns, "link", "set", "br0", "up"])
        for n in self.names:
            ns = self.netns(n)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", self.bridge_netns, "link", "add", self._port[n], "type", "veth", "peer", "name", "eth0",
                  "address", self._mac[n], "netns", ns])
            _run(["ip", "-n", self.bridge_netns, "link", "set", self._port[n], "master", "br0", "up"])
            _run(["ip", "-n", ns, "-batch", "-"], input="link set lo up\n"
                 f"addr add {self._addr[n]}/24 dev eth0\nlink set eth0 up\n" + self._neighbours(n))
            (self.dir / f"{n}.mnt").touch()
            (self.dir / f"{n}.uts").touch()
            cfg = {"hostname": n, "shared": [str(p) for p in self.shared], "stage": str(self.dir / f"stage-{n}"),
                   "hosts_file": str(hosts_file), "drop": [str(_NETNS_DIR), str(ROOT)]}
            _run(["nsenter", f"--net={_NETNS_DIR / ns}", "--", "unshare", f"--mount={self.dir / n}.mnt",
                  f"--uts={self.dir / n}.uts", "--propagation", "private", "--",
                  sys.executable, "-I", "-c", _SETUP, json.dumps(cfg)])

    def _neighbours(self, name: str) -> str:
        # Permanent neighbour entries: no ARP ever, so a cut port looks like a black hole (SYNs and
        # data vanish, connects time out) rather than a failed ARP (EHOSTUNREACH after about 3 s).
        return "".join(f"neigh replace {a} lladdr {self._mac[n]} dev eth0 nud permanent\n"
                       for n, a in self._addr.items() if n != name)

    # -- queries --------------------------------------------------------------------------------

    def addr(self, name: str) -> str:
        """Host ``name``'s address (on its eth0; /etc/hosts of every host maps the name to it)."""
        return self._addr[self._known(name)]

    def netns(self, name: str) -> str:
        """The name of host ``name``'s network namespace (``ip netns``)."""
        return f"{self.instance}-{self._known(name)}"

    def namespace_files(self, name: str) -> dict[str, Path]:
        """Host ``name``'s namespace files: ``{"net": ..., "mnt": ..., "uts": ...}``."""
        self._known(name)
        return {"net": _NETNS_DIR / self.netns(name), "mnt": self.dir / f"{name}.mnt", "uts": self.dir / f"{name}.uts"}

    def pids(self, name: str) -> list[int]:
        """Every live process in host ``name``'s network namespace."""
        ns = _ns_id(_NETNS_DIR / self.netns(name))
        if ns is None:
            return []
        return [p for p in _members({ns}) if _ns_id(f"/proc/{p}/ns/net") == ns]

    def _known(self, name: str) -> str:
        if name not in self.names:
            raise KeyError(f"no host {name!r}; hosts are {self.names}")
        return name

    # -- processes ------------------------------------------------------------------------------

    def command(self, name: str, argv: Sequence[str | os.PathLike[str]], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """``argv`` prefixed so that it runs inside host ``name`` with working directory ``cwd``
        (default: this process's). nsenter's own --wd opens the directory before it enters the
        mount namespace, leaving the process in a directory of the root's tree; ``env --chdir``
        changes directory inside, so ``cwd`` must exist there (any path outside /tmp and /dev/shm,
        or in a shared path)."""
        f = self.namespace_files(name)
        return ["nsenter", f"--net={f['net']}", f"--mount={f['mnt']}", f"--uts={f['uts']}", "--",
                "env", f"--chdir={os.fspath(cwd) if cwd is not None else os.getcwd()}", "--",
                *(os.fspath(a) for a in argv)]

    def popen(self, name: str, argv: Sequence[str | os.PathLike[str]], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in host ``name``: ``subprocess.Popen`` with ``popen_kwargs`` (env, stdout,
        start_new_session, ...; ``cwd`` is applied inside the host). nsenter and env exec the
        program, so the Popen's pid is the program's. close() kills and reaps it."""
        cwd = popen_kwargs.pop("cwd", None)
        if self._closed:
            raise RuntimeError(f"{self.instance} is closed")
        p = subprocess.Popen(self.command(name, argv, cwd), **popen_kwargs)
        self._procs.append(p)
        return p

    def run(self, name: str, argv: Sequence[str | os.PathLike[str]], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in host ``name`` to its end: ``subprocess.run`` with ``kw`` (give a timeout)."""
        cwd = kw.pop("cwd", None)
        if self._closed:
            raise RuntimeError(f"{self.instance} is closed")
        return subprocess.run(self.command(name, argv, cwd), **kw)

    # -- network failure ------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Take host ``name``'s switch port (the bridge end of its veth) down: like a failing switch
        port or cable, nothing gets to or from the host, while the host itself keeps its eth0
        configured (address, route, neighbours) and its processes run on. Its packets are dropped
        silently, so connects to and from it time out and established connections stall. Taking
        the host end down instead would remove its route, and its own connects would fail at once
        with ENETUNREACH, which no real network failure does."""
        _run(["ip", "-n", self.bridge_netns, "link", "set", self._port[self._known(name)], "down"])

    def restore(self, name: str) -> None:
        """Bring host ``name``'s switch port back up; returns once the bridge forwards on it, so
        new connections work at once (stalled ones resume at their next retransmission)."""
        port = self._port[self._known(name)]
        _run(["ip", "-n", self.bridge_netns, "link", "set", port, "up"])
        # The kernel keeps permanent neighbour entries over a carrier loss; putting them back is
        # cheap and keeps the black-hole behaviour of the next cut whatever the kernel did.
        _run(["ip", "-n", self.netns(name), "-batch", "-"], input=self._neighbours(name))
        deadline = time.monotonic() + _COMMAND_TIMEOUT_S
        while True:
            links = json.loads(_run(["bridge", "-n", self.bridge_netns, "-j", "link", "show", "dev", port]) or "[]")
            if links and links[0].get("state") == "forwarding":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"bridge port {port} of {name} not forwarding after {_COMMAND_TIMEOUT_S} s: {links}")
            time.sleep(0.01)

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in the hosts (SIGKILL, by namespace membership: daemons in their own
        sessions included), reap the ones this process started, delete the namespaces and remove the
        namespace files and directory. Idempotent. RuntimeError naming what could not be removed,
        after removing all the rest."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        # The processes popen started, killed directly too: one may not be in the namespaces yet
        # (nsenter stopped or slow before its setns calls), so membership alone would miss it.
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        if self.instance:
            _teardown(self.instance, errors)
        for p in self._procs:
            try:
                p.wait(timeout=_KILL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                errors.append(f"process {p.pid} ({p.args}) did not exit")
        if errors:
            raise RuntimeError(f"closing {self.instance}: {'; '.join(errors)}")

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
