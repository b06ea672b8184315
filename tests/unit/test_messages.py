"""The trainer-to-writer messages: typed round trips, strict decoding, and versions that refuse each other."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

import pytest
import torch

import zerostall
from zerostall import SaveOptions, WriterKind
from zerostall.errors import StorageError, WriterError
from zerostall.memtier.messages import (
    Adopt,
    Closed,
    Image,
    ImageFile,
    ImageQuery,
    KeeperBusy,
    KeeperFailed,
    Persisted,
    PersistHeld,
)
from zerostall.messages import (
    PROTOCOL,
    Close,
    Collective,
    Done,
    Failed,
    FileRow,
    ForgetLayout,
    Hello,
    LeafLayout,
    LeafRow,
    MapBuffer,
    ProtocolMismatchError,
    Released,
    SaveJob,
    UnmapBuffer,
    WriteOptions,
    WriterStats,
    decode,
    encode,
    to_wire,
)
from zerostall.options import RetentionPolicy

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src")

JOB = SaveJob(
    id=7, root="/r", name="step_00000003", path="/r/step_00000003",
    files=(FileRow(name="rank-00000.safetensors", length=4160, buffer=2),),
    leaves=(LeafRow(key="pytree/w", kind="torch", dtype="BF16", shape=(2, 3), file=0, offset=128, nbytes=12),
            LeafRow(key="pytree/s", kind="numpy_scalar", dtype="I64", shape=(), file=0, offset=192, nbytes=8,
                    shared=False)),
    items={"pytree": {"type": "dict", "keys": ["w"], "values": [{"type": "array", "leaf": 0}]}},
    metadata={"loss": 0.5}, step=3, retention=RetentionPolicy(keep_last=2, keep_every_n_steps=10),
    env={"AWS_REGION": "eu"}, write=WriteOptions(direct_io=True, io_threads=1, chunk_bytes=64 << 20),
    collective=Collective(rank=1, world=4, run="abc", counter=9, timeout_s=30.0, poll_s=0.02),
    crcs=(0xDEADBEEF, None),
)

MESSAGES = [
    Hello(protocol=PROTOCOL, library="0.1.0", pid=12), MapBuffer(buffer=2, size=8192), UnmapBuffer(buffer=2),
    JOB, Close(), Released(job=7),
    Done(job=7, stats=WriterStats(nbytes=4160, write_s=0.1, commit_s=0.01, persist_s=0.2, writer_peak_rss=10,
                                  deleted_steps=(1, 2), retention_error="x", rank=1, leaves_written=1)),
    Failed(job=7, error=to_wire(StorageError("disk full", errno=28, path="/r/s", key="k", rank=2))),
    # the memory tier
    Adopt(root="/r", rank=1), ImageQuery(),
    Image(step=3, name="step_00000003", manifest="{}", files=(ImageFile(name="rank-00000.safetensors", length=4160,
                                                                      size=8192),)),
    Image(step=None, name="", manifest="", files=()),
    KeeperFailed(step=4, path="/r/step_00000004", rank=1, error=to_wire(OSError(28, "No space left on device"))),
    KeeperBusy(pid=4242),
    dataclasses.replace(JOB, memory=True, persist=False),
    Done(job=7, stats=WriterStats(nbytes=4160, tiers=("memory",))),
    # who holds a keeper's name (the bind race)
    Image(step=None, name="", manifest="", files=(), trainer_pid=4242), KeeperBusy(pid=77, pid_is_keeper=True),
    # the directory's instance, and the keeper's word that the step it held is stored at a close
    Adopt(root="/r", rank=1, instance="9f0c"), Image(step=3, name="step_00000003", manifest="{}", files=(),
                                                      instance="9f0c"),
    Closed(step=10), Closed(step=None),
    # the trainer's wait(): persist the held step now, and the keeper's answer
    PersistHeld(request=3), Persisted(request=3, step=12), Persisted(request=4, step=None),
    # a layout sent once, then named by the jobs of that layout
    LeafLayout(id=3, leaves=JOB.leaves, items=JOB.items), ForgetLayout(id=3),
    dataclasses.replace(JOB, leaves=(), items={}, layout=3, order=("pytree",)),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: object) -> None:
    data = encode(msg)  # type: ignore[arg-type]
    doc = json.loads(data)
    assert doc["v"] == PROTOCOL and isinstance(doc["op"], str)
    assert decode(data) == msg


def _doc(msg: object) -> dict:
    return json.loads(encode(msg))  # type: ignore[arg-type]


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d.update(op="explode"), "unknown op 'explode'"),
    (lambda d: d.pop("root"), "save lacks 'root'"),
    (lambda d: d.update(id=True), "save.id must be int"),
    (lambda d: d.update(id="7"), "save.id must be int"),
    (lambda d: d["leaves"][0].update(shape="2x3"), "save.leaves[0].shape must be a list"),
    (lambda d: d["leaves"][1].update(crc32c="beef"), "save.leaves[1].crc32c must be int"),
    (lambda d: d["leaves"][1].update(shared=0), "save.leaves[1].shared must be bool"),
    (lambda d: d["files"][0].pop("buffer"), "save.files[0] lacks 'buffer'"),
    (lambda d: d["retention"].update(keep_last=0), "keep_last must be"),
    (lambda d: d["write"].update(direct_io=1), "save.write.direct_io must be bool"),
    (lambda d: d.update(env=[]), "save.env must be an object"),
])
def test_malformed_messages_are_refused_naming_the_field(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    d = _doc(JOB)
    mutate(d)
    with pytest.raises(WriterError, match="malformed writer message") as ei:
        decode(json.dumps(d).encode())
    assert needle in str(ei.value)


def test_not_json_is_refused() -> None:
    with pytest.raises(WriterError, match="not JSON"):
        decode(b"\xff{")


def test_another_protocol_version_is_refused_naming_both() -> None:
    d = _doc(Hello(protocol=PROTOCOL, library="0.1.0", pid=1))
    d.update(v=PROTOCOL + 98, protocol=PROTOCOL + 98, library="9.9.9")
    with pytest.raises(ProtocolMismatchError) as ei:
        decode(json.dumps(d).encode())
    msg = str(ei.value)
    assert f"protocol {PROTOCOL + 98}" in msg and "zerostall 9.9.9" in msg and f"protocol {PROTOCOL}" in msg
    assert isinstance(ei.value, WriterError)


def test_a_real_writer_introduces_itself_and_refuses_another_protocol() -> None:
    """The writer process says Hello first; a message of another version makes it exit with a clear line."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.Popen([sys.executable, "-m", "zerostall.persist.server", str(child.fileno()), "0"],
                            pass_fds=(child.fileno(),), env=env, stderr=subprocess.PIPE, text=True)
    child.close()
    conn = Connection(parent.detach())
    try:
        hello = decode(conn.recv_bytes())
        assert isinstance(hello, Hello) and hello.protocol == PROTOCOL and hello.pid == proc.pid
        assert hello.library == zerostall.__version__
        conn.send_bytes(json.dumps({"v": PROTOCOL + 1, "op": "close"}).encode())
        _, err = proc.communicate(timeout=60)
    finally:
        conn.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert f"speaks protocol {PROTOCOL + 1}" in err and f"this process protocol {PROTOCOL}" in err


def test_a_trainer_refuses_a_writer_of_another_protocol(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A writer that introduces itself with another protocol fails the save clearly, and the next
    save is refused the same way instead of starting writer after writer."""
    import zerostall.persist.server as server

    started = []

    def old_writer(conn: Connection, **_: object) -> None:  # what a writer of another zerostall version would say
        started.append(1)
        conn.send_bytes(json.dumps({"v": PROTOCOL + 1, "op": "hello", "protocol": PROTOCOL + 1,
                                    "library": "0.0.1", "pid": os.getpid()}).encode())
        try:
            while True:
                conn.recv_bytes()
        except (EOFError, OSError):
            conn.close()

    monkeypatch.setattr(server, "serve", old_writer)
    with zerostall.Checkpointer(tmp_path / "run", save_options=SaveOptions(writer=WriterKind.THREAD)) as ck:
        # The Checkpointer starts its writer at once: the mismatch may be known before the first
        # save (which then fails at the call) or only during it (its result() fails).
        with pytest.raises(ProtocolMismatchError, match=r"zerostall 0\.0\.1"):
            ck.save_pytree_async(1, {"w": torch.ones(3)}).result(timeout=30)
        with pytest.raises(ProtocolMismatchError):
            ck.save_pytree_async(2, {"w": torch.ones(3)})
    assert len(started) == 1
    assert ck.steps() == []


def test_an_image_without_verified_decodes_as_not_verified() -> None:
    # What a keeper of the same protocol from before Image.verified sends: the load then verifies.
    doc = json.loads(encode(Image(step=3, name="s", manifest="{}", files=(), verified=True)))
    del doc["verified"]
    old = decode(json.dumps(doc).encode())
    assert isinstance(old, Image) and old.verified is False
    assert decode(encode(Image(step=3, name="s", manifest="{}", files=(), verified=True))) == \
        Image(step=3, name="s", manifest="{}", files=(), verified=True)


def test_a_keepers_hello_says_why_it_cannot_be_adopted_without_a_protocol_bump() -> None:
    why = to_wire(StorageError("permission denied", errno=13, path="/r"))
    hello = Hello(protocol=PROTOCOL, library="0.1.0", pid=5, unadoptable=why)
    assert decode(encode(hello)) == hello
    # An older keeper's Hello (no such field) is an adoptable keeper's; an older trainer ignores the field.
    d = _doc(hello)
    del d["unadoptable"]
    assert decode(json.dumps(d).encode()) == Hello(protocol=PROTOCOL, library="0.1.0", pid=5, unadoptable=None)


def test_a_job_naming_a_layout_is_filled_in_with_its_rows_and_nodes() -> None:
    from zerostall.errors import UnknownLayoutError
    from zerostall.messages import node_delta, node_index, resolve_layout

    model = {"type": "dict", "keys": ["w"], "values": [{"type": "array", "leaf": 0}]}
    items = {"pytree": {"type": "dict", "keys": ["model", "step"], "values": [model, {"type": "int", "value": 1}]}}
    layout = LeafLayout(id=2, leaves=JOB.leaves, items=items)
    index = node_index(items)
    now = {"type": "dict", "keys": ["model", "step"], "values": [model, {"type": "int", "value": 2}]}
    delta = node_delta(now, index)
    assert delta["values"][0] == {"type": "layout-ref", "path": ["pytree", 0]}  # the model's node is not sent
    job = dataclasses.replace(JOB, leaves=(), items={"pytree": delta}, layout=2, order=("pytree",))
    sent = decode(encode(job))
    assert isinstance(sent, SaveJob)
    full = resolve_layout(sent, {2: layout})
    assert full.leaves == JOB.leaves and full.items == {"pytree": now} and full.layout == 0
    assert resolve_layout(dataclasses.replace(job, items={}), {2: layout}).items == items  # unchanged: the layout's
    for bad, needle in ((dataclasses.replace(job, layout=9), "leaf layout 9"),
                        (dataclasses.replace(job, order=("other",), items={}), "item 'other'"),
                        (dataclasses.replace(job, items={"pytree": {"type": "layout-ref", "path": ["pytree", 5]}}),
                         "node ['pytree', 5]")):
        with pytest.raises(UnknownLayoutError, match=re.escape(needle)) as info:
            resolve_layout(bad, {2: layout})
        assert info.value.path == JOB.path
