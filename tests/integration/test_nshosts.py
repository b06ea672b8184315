"""The namespace hosts of tests/support/nshosts.py do what the multi-host tests rely on: hosts
talk TCP over their own addresses, each has its own hostname, /dev/shm and /tmp but all see the
shared path, a cut host gets no bytes through until restored, a stopped process is a hung peer,
and nothing is left behind, also when the test raises or its process was killed."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from memtier_procs import running, wait_for
from nshosts import ROOT, SUBNET, Hosts, NamespacesUnavailable

MakeHosts = Callable[..., Hosts]
PORT = 7000  # every host has a network namespace of its own: no other test can hold this port
TIMEOUT_S = 1.0  # a connect or recv that gets no answer within this is the "no bytes" outcome
CUT_TIMEOUT_S = 4.5  # connects to and from a cut host: see test_cut_host_gets_no_bytes_through_until_restored

# A TCP server: listens on ADDR:PORT, prints READY, then answers each connection's first line
# with "<hostname>:<line>".
SERVER = r"""
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])), backlog=16)
print("READY", flush=True)
while True:
    c, _ = s.accept()
    try:
        with c:
            line = c.makefile("rb").readline()
            c.sendall(socket.gethostname().encode() + b":" + line)
    except OSError:  # a client that gave up and left: serve the next
        pass
"""

# A TCP client: connects to HOST:PORT with a timeout, sends a line, prints the answer or what
# went wrong (connect-timeout, recv-timeout, or the error's name).
CLIENT = r"""
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
except socket.timeout:
    sys.exit(print("connect-timeout"))
except OSError as e:
    sys.exit(print(type(e).__name__))
try:
    c.sendall(b"ping\n")
    print(c.recv(100).decode().strip() or "closed")
except socket.timeout:
    print("recv-timeout")
"""


def serve(h: Hosts, name: str) -> subprocess.Popen[str]:
    """A SERVER in host ``name`` on its address, started and listening."""
    p = h.popen(name, [sys.executable, "-c", SERVER, h.addr(name), str(PORT)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    return p


def start_client(h: Hosts, name: str, to: str, timeout: float = TIMEOUT_S) -> subprocess.Popen[str]:
    """A CLIENT in host ``name`` to ``to`` (a host name or address)."""
    return h.popen(name, [sys.executable, "-c", CLIENT, to, str(PORT), str(timeout)], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True)


def connect(h: Hosts, name: str, to: str, timeout: float = TIMEOUT_S) -> str:
    """What a CLIENT in host ``name`` to ``to`` printed."""
    out, err = start_client(h, name, to, timeout).communicate(timeout=30)
    assert not err, err
    return out.strip()


def in_host(h: Hosts, name: str, code: str, *args: str) -> str:
    """What Python ``code`` printed, run in host ``name`` (it must succeed)."""
    p = h.run(name, [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def netns_list() -> set[str]:
    return {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                       check=True).stdout.splitlines() if line.strip()}


def mount_targets() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f]


def test_tcp_between_hosts_by_address_and_by_name(nshosts: MakeHosts, tmp_path: Path) -> None:
    h = nshosts(["a", "b", "c"], shared=[tmp_path])
    server = serve(h, "a")
    assert connect(h, "b", h.addr("a")) == "a:ping"
    assert connect(h, "c", "a") == "a:ping"  # by name, through every host's /etc/hosts
    assert server.poll() is None


def test_each_host_has_its_own_hostname_resolving_to_its_own_address(nshosts: MakeHosts, tmp_path: Path) -> None:
    h = nshosts(["a", "b"], shared=[tmp_path])
    assert h.addr("a") != h.addr("b")
    for name in h.names:
        assert ipaddress.ip_address(h.addr(name)) in ipaddress.ip_network(SUBNET)
        got = in_host(h, name, "import socket; n = socket.gethostname(); print(n, socket.gethostbyname(n))")
        assert got == f"{name} {h.addr(name)}"
        # The address is routable, not loopback: it is the one on the host's eth0.
        assert h.addr(name) in in_host(h, name, "import subprocess; print(subprocess.check_output(['ip', '-4', 'addr', 'show', 'eth0'], text=True))")


def test_dev_shm_and_tmp_are_per_host(nshosts: MakeHosts, tmp_path: Path) -> None:
    h = nshosts(["a", "b"], shared=[tmp_path])
    tag = f"nshosts-test-{os.getpid()}-{time.monotonic_ns()}"
    write = "import sys; [open(f'{d}/{sys.argv[1]}', 'w').write(sys.argv[2]) for d in ('/dev/shm', '/tmp')]"
    read = "import os, sys; print([open(p).read() if os.path.exists(p) else None for p in (f'/dev/shm/{sys.argv[1]}', f'/tmp/{sys.argv[1]}')])"
    in_host(h, "a", write, tag, "from-a")
    assert in_host(h, "a", read, tag) == "['from-a', 'from-a']"  # a second process of host a
    assert in_host(h, "b", read, tag) == "[None, None]"
    assert not Path("/dev/shm", tag).exists() and not Path("/tmp", tag).exists()  # nor the root's
    in_host(h, "b", write, tag, "from-b")  # the same names in another host are other files
    assert in_host(h, "a", read, tag) == "['from-a', 'from-a']"
    assert in_host(h, "b", read, tag) == "['from-b', 'from-b']"


def test_shared_path_is_the_same_directory_in_every_host(nshosts: MakeHosts, tmp_path: Path) -> None:
    h = nshosts(["a", "b"], shared=[tmp_path])
    f = tmp_path / "from-b"
    in_host(h, "b", "import sys; open(sys.argv[1], 'w').write('b wrote')", str(f))
    assert in_host(h, "a", "import sys; print(open(sys.argv[1]).read())", str(f)) == "b wrote"
    assert f.read_text() == "b wrote"
    (tmp_path / "from-test").write_text("test wrote")
    assert in_host(h, "b", "import sys; print(open(sys.argv[1]).read())", str(tmp_path / "from-test")) == "test wrote"
    # The working directory may be in the shared path too: it is entered inside the host.
    p = h.run("a", [sys.executable, "-c", "import os; print(os.getcwd()); print(open('from-b').read())"],
              cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert p.stdout.split("\n")[:2] == [str(tmp_path), "b wrote"], p.stderr


def test_cut_host_gets_no_bytes_through_until_restored(nshosts: MakeHosts, tmp_path: Path) -> None:
    h = nshosts(["a", "b", "c"], shared=[tmp_path])
    server_a, server_b = serve(h, "a"), serve(h, "b")
    assert connect(h, "b", "a") == "a:ping" and connect(h, "a", "b") == "b:ping"
    h.cut("b")
    # Longer than the about 3 s after which a failed ARP would end a connect with EHOSTUNREACH: a
    # cut is a black hole, and a connect to or from the cut host just gets no answer. The three
    # run at once to keep the test short.
    t = time.monotonic()
    clients = {(src, dst): start_client(h, src, dst, CUT_TIMEOUT_S) for src, dst in (("b", "a"), ("a", "b"), ("c", "b"))}
    got = {k: p.communicate(timeout=30)[0].strip() for k, p in clients.items()}
    assert got == dict.fromkeys(clients, "connect-timeout")
    assert time.monotonic() - t < CUT_TIMEOUT_S + 5
    assert connect(h, "c", "a") == "a:ping"  # the others still reach each other
    assert server_a.poll() is None and server_b.poll() is None
    assert server_b.pid in h.pids("b")
    h.restore("b")
    assert connect(h, "b", "a") == "a:ping" and connect(h, "a", "b") == "b:ping"


def test_stopped_process_holds_its_socket_but_answers_nothing(nshosts: MakeHosts, tmp_path: Path) -> None:
    h = nshosts(["a", "b"], shared=[tmp_path])
    server = serve(h, "a")
    os.kill(server.pid, signal.SIGSTOP)
    wait_for(lambda: open(f"/proc/{server.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T", "the stop", 10)
    # The kernel completes the handshake from the listen backlog; nobody reads or answers.
    assert connect(h, "b", "a") == "recv-timeout"
    assert server.poll() is None
    os.kill(server.pid, signal.SIGCONT)
    assert connect(h, "b", "a") == "a:ping"  # the queued connection was taken first; this one is answered


def test_root_namespace_gets_no_test_address_or_route(nshosts: MakeHosts, tmp_path: Path) -> None:
    h = nshosts(["a", "b"], shared=[tmp_path])
    subnet = ipaddress.ip_network(SUBNET)
    addrs = json.loads(subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, check=True).stdout)
    local = [a["local"] for link in addrs for a in link.get("addr_info", [])]
    assert local and not [a for a in local if ipaddress.ip_address(a.split("%")[0]) in subnet]
    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True,
                                       text=True, check=True).stdout)
    dsts = [r["dst"] for r in routes if r.get("dst") not in (None, "default")]
    assert not [d for d in dsts if ipaddress.ip_network(d, strict=False).overlaps(subnet)]
    assert in_host(h, "a", "print(1)") == "1"  # the hosts were there while the root was looked at


def test_instances_get_distinct_subnets_and_same_names_coexist(nshosts: MakeHosts, tmp_path: Path) -> None:
    h1, h2 = nshosts(["a", "b"], shared=[tmp_path]), nshosts(["a"], shared=[tmp_path])
    assert h1.addr("a").rsplit(".", 1)[0] != h2.addr("a").rsplit(".", 1)[0]
    assert in_host(h2, "a", "import socket; print(socket.gethostname())") == "a"
    assert {h1.netns("a"), h1.netns("b"), h2.netns("a")} <= netns_list()


def test_close_removes_everything_even_when_the_block_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the test failed"), Hosts(["a", "b"], shared=[tmp_path]) as h:
        sleeper = h.popen("a", ["sleep", "300"])
        # A keeper-like daemon: its own session, its parent gone, no process group of ours.
        starter = h.popen("b", ["sh", "-c", "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!"],
                          stdout=subprocess.PIPE, text=True)
        assert starter.stdout is not None
        daemon = int(starter.stdout.readline())
        stopped = h.popen("b", ["sleep", "300"])
        wait_for(lambda: Path(f"/proc/{stopped.pid}/comm").read_text() == "sleep\n", "sleep to start", 10)
        os.kill(stopped.pid, signal.SIGSTOP)  # a hung process dies by SIGKILL too
        assert sleeper.pid in h.pids("a") and {daemon, stopped.pid} <= set(h.pids("b"))
        names = {h.netns("a"), h.netns("b"), h.bridge_netns}
        assert names <= netns_list()
        files = [f for n in h.names for f in h.namespace_files(n).values()]
        instance_dir = h.dir
        raise RuntimeError("the test failed")
    assert not names & netns_list()
    assert not [p for p in (sleeper.pid, daemon, stopped.pid) if running(p)]
    assert sleeper.returncode == -signal.SIGKILL  # reaped by close
    assert not [f for f in files if f.exists()] and not instance_dir.exists()
    assert not [t for t in mount_targets() if str(instance_dir) in t]
    h.close()  # again: nothing left to do


def test_leftovers_of_a_killed_creator_are_removed_by_the_next_instance(nshosts: MakeHosts, tmp_path: Path) -> None:
    creator = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, nshosts\n"
         "h = nshosts.Hosts(['x'], shared=[sys.argv[1]])\n"
         "p = h.popen('x', ['sleep', '300'])\n"
         "print(h.instance, h.netns('x'), h.bridge_netns, p.pid, flush=True)\n"
         "time.sleep(300)\n", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert creator.stdout is not None
    instance, netns_x, netns_br, pid = creator.stdout.readline().split()
    creator.kill()
    creator.wait(timeout=30)
    assert {netns_x, netns_br} <= netns_list() and running(int(pid))  # what the SIGKILL left behind
    nshosts(["a"], shared=[tmp_path])
    assert not {netns_x, netns_br} & netns_list()
    assert not running(int(pid))
    assert not (ROOT / instance).exists()
    assert not [t for t in mount_targets() if instance in t]


def test_unavailable_namespaces_raise_naming_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no ip, unshare, nsenter...
    with pytest.raises(NamespacesUnavailable, match="not on PATH: ip"):
        Hosts(["a"], shared=[tmp_path])
    monkeypatch.undo()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.setuid(65534)
            Hosts(["a"])
            os.write(w, b"made")
        except NamespacesUnavailable as e:
            os.write(w, str(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    assert "root" in said, said


def test_shared_paths_are_bound_once_and_a_checkout_under_tmp_is_among_them(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A host's private /tmp hides whatever lies under /tmp: a checkout or virtualenv there is
    shared into every host (else no process started in one could import zerostall); a path inside
    another shared one is bound once, through the outer one."""
    from pathlib import Path

    import nshosts

    assert nshosts._outermost([Path("/a/b"), Path("/a"), Path("/c"), Path("/a")]) == (Path("/a"), Path("/c"))
    venv = tmp_path / "clone" / ".venv"
    venv.mkdir(parents=True)
    assert Path("/tmp") in venv.resolve().parents  # pytest's tmp_path lies under /tmp here
    monkeypatch.setattr(nshosts.sys, "prefix", str(venv))
    monkeypatch.setattr(nshosts.sys, "base_prefix", "/usr")
    hidden = nshosts._hidden_by_private_tmp()
    assert venv.resolve() in hidden and Path("/usr") not in hidden
