"""The replica transport between real processes: keepers on separate hosts, made as network
namespaces (tests/support/nshosts.py: each its own address and hostname), form an authenticated
gloo group through the job's TCPStore (in host a) and send a staged step from host a's process to
host b's; an intruder runs on host c. One launch of the three processes (``_replica_worker.py``)
runs every scenario: starting torch in a process costs seconds on a small machine, the steps are
a few MiB.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

HERE = os.path.dirname(__file__)
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")


@pytest.fixture(scope="module")
def results() -> Iterator[dict[tuple[str, str], dict]]:
    from hostjob import JobStore
    from nshosts import Hosts, NamespacesUnavailable

    try:
        hosts = Hosts(["a", "b", "c"])
    except NamespacesUnavailable as exc:
        pytest.fail(f"the hosts of this test are network namespaces, which cannot be made here: {exc}")
    with hosts:
        store = JobStore(hosts, "a")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
        env.pop("ZEROSTALL_HOST_ID", None)
        procs = {role: hosts.popen(host, [sys.executable, os.path.join(HERE, "_replica_worker.py"), role, store.addr,
                                          str(store.port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
                 for role, host in (("a", "a"), ("b", "b"), ("x", "c"))}
        out: dict[tuple[str, str], dict] = {}
        errs: dict[str, str] = {}

        def read(role: str, p: subprocess.Popen[str]) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                if line.startswith("{"):
                    d = json.loads(line)
                    out[(d["role"], d["scenario"])] = d
                    if (d["role"], d["scenario"]) == ("b", "hung"):  # a hung mid-transfer: let it go on
                        os.kill(procs["a"].pid, signal.SIGCONT)

        def drain(role: str, p: subprocess.Popen[str]) -> None:
            assert p.stderr is not None
            errs[role] = p.stderr.read()[-3000:]

        threads = [threading.Thread(target=f, args=(r, p), daemon=True) for r, p in procs.items() for f in (read, drain)]
        for t in threads:
            t.start()
        for role, p in procs.items():
            try:
                code = p.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                code = p.wait()
            out[("parent", "exit-" + role)] = {"status": code}
        for t in threads:
            t.join(timeout=10)
        out[("all", "stderr")] = {"text": "\n".join(f"{r}: {e}" for r, e in errs.items())}
        yield out


def _get(results: dict, role: str, scenario: str) -> dict:
    got = results.get((role, scenario))
    assert got is not None, f"{role} did not report {scenario}: {results.get((role, 'crash'))} " \
                            f"{results[('all', 'stderr')]['text']}"
    return got


@pytest.mark.parametrize("scenario,reason", [("wrong-secret", "does not verify"), ("other-job", "of job 'job-2'"),
                                             ("other-user", "runs as uid 65534")])
def test_a_keeper_without_the_job_s_credentials_is_refused_and_logged(results, scenario, reason) -> None:
    if scenario == "other-user" and os.getuid() != 0:
        pytest.skip("starting another user's keeper needs root")
    for role in ("a", "b"):
        got = _get(results, role, scenario)
        assert got["members"] == [0, 1] and got["refused"] == [2], got
        assert any("refused member 2 on host 'c~" in w and reason in w for w in got["warned"]), got
    intruder = _get(results, "x", scenario)
    assert intruder.get("error") == "ReplicaError" and "proved membership" in intruder["message"], intruder




def test_a_step_arrives_byte_identical_and_verified(results) -> None:
    sent, got = _get(results, "a", "intact"), _get(results, "b", "intact")
    assert "ok" in sent, sent
    assert got["ok"]["digest"] == sent["digest"]
    assert got["ok"]["of"] == ["run-1", 8, 0, 100]
    assert got["ok"]["names"] == ["file0", "file1"] and got["ok"]["lengths"] == [(3 << 20) + (1 << 19), (1 << 20) + 5]


def test_a_step_of_another_run_is_refused_by_the_receiver_and_the_sender_is_told(results) -> None:
    got, sent = _get(results, "b", "wrong-run"), _get(results, "a", "wrong-run")
    assert got.get("error") == "ReplicaError" and "expected run 'run-2'" in got["message"], got
    assert sent.get("error") == "ReplicaError" and "did not expect this step" in sent["message"], sent


def test_a_byte_flipped_after_staging_is_never_held_and_both_ends_raise(results) -> None:
    got, sent = _get(results, "b", "flipped"), _get(results, "a", "flipped")
    assert got.get("error") == "ReplicaError" and got["key"] == "f1/leaf3", got
    assert "differ from the CRC32C taken at staging" in got["message"]
    assert sent.get("error") == "ReplicaError" and "not replicated" in sent["message"], sent


def test_a_connection_whose_peer_lacks_the_key_gets_no_step_bytes(results) -> None:
    got, sent = _get(results, "b", "link-proof"), _get(results, "a", "link-proof")
    assert got.get("error") == "ReplicaError" and "nothing was accepted" in got["message"], got
    assert sent.get("error") == "ReplicaError" and "nothing was sent" in sent["message"], sent
    assert any("link proof does not verify" in w for w in got["warned"]), got


def test_a_silent_peer_is_a_replica_error_at_the_timeout(results) -> None:
    got = _get(results, "b", "silent")
    assert got.get("error") == "ReplicaError" and "Timed out" in got["message"], got


def test_a_peer_killed_mid_transfer_is_a_replica_error(results) -> None:
    got = _get(results, "b", "kill")
    assert got.get("error") == "ReplicaError" and "receiving a piece" in got["message"], got
    assert _get(results, "parent", "exit-a")["status"] == -9  # it died in its progress callback, mid-transfer
    assert _get(results, "parent", "exit-b")["status"] == 0


def test_a_peer_that_hangs_mid_transfer_is_a_replica_error_at_the_timeout(results) -> None:
    got, sent = _get(results, "b", "hung"), _get(results, "a", "hung")
    assert got.get("error") == "ReplicaError" and "Timed out" in got["message"], got
    assert got["seconds"] < 3.0 + 3.0, got  # its timeout (3 s), not the hung peer, ended it
    assert sent.get("error") == "ReplicaError", sent  # once continued, the sender learns the step did not arrive


def test_two_keepers_send_each_other_a_step_at_once(results) -> None:
    a, b = _get(results, "a", "both-ways"), _get(results, "b", "both-ways")
    assert "ok" in a["sent"] and "ok" in b["sent"], (a, b)
    assert a["got"]["ok"] == b["digest"] and b["got"]["ok"] == a["digest"], (a, b)
    assert a["digest"] != b["digest"]
