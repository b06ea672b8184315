"""A memory-tier keeper of an S3 prefix that was deleted and written again offers nothing to the new one.

A trainer with a memory tier on ``s3://bucket/prefix`` saves steps 1..7 (step 5 persisted) and is
SIGKILLed; its keeper lingers, holding step 7. Every object under the prefix is then deleted, and a
new trainer starts on the same URL: it starts fresh (the prefix's instance marker is a new one), and
the old keeper persists nothing into it and exits. Real SeaweedFS (``conftest.py``), real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from memtier_procs import DEADLINE_S, TRAINER, running, wait_for

from zerostall import Checkpointer, MemoryTier
from zerostall.commit import committed_steps
from zerostall.memtier.instance import INSTANCE_KEY, read_instance
from zerostall.memtier.spec import query_held
from zerostall.persist.faults import ENV as FAULTS_ENV
from zerostall.persist.faults import MARK_ENV
from zerostall.storage import open_storage

LINGER_S = 300.0  # longer than DEADLINE_S: a keeper that merely expires fails the test


def _delete_prefix(s3_server: Any, url: str) -> None:
    bucket, prefix = url[len("s3://"):].split("/", 1)
    c = s3_server.client()
    keys = [o["Key"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
            for o in page.get("Contents", [])]
    assert keys
    for k in keys:
        c.delete_object(Bucket=bucket, Key=k)
    assert not c.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents")


def test_a_new_trainer_on_a_deleted_and_recreated_s3_prefix_starts_fresh(s3_url: str, s3_server: Any,
                                                                           tmp_path: Path) -> None:
    mark, go = tmp_path / "mark", tmp_path / "go"
    mark.mkdir()
    # The keeper's persist after the crash waits until the prefix has been replaced.
    env = dict(os.environ, **{FAULTS_ENV: json.dumps({"keeper_persist": f"wait:{go}"}), MARK_ENV: str(mark)})
    p = subprocess.run([sys.executable, TRAINER, s3_url, "1", "7", "5", str(LINGER_S), "kill"],
                       stdout=subprocess.PIPE, text=True, timeout=DEADLINE_S, env=env)
    assert p.returncode == -signal.SIGKILL and "SAVED 7 memory" in p.stdout
    keeper = next(int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("KEEPER "))
    try:
        storage = open_storage(s3_url)
        assert committed_steps(storage) == [5]
        old = read_instance(storage)
        assert old is not None
        wait_for(lambda: any(f.name.startswith("keeper_persist-") for f in mark.iterdir()), "the keeper's persist")
        held = query_held(s3_url, 0)
        assert held is not None and held.step == 7

        _delete_prefix(s3_server, s3_url)
        with Checkpointer(s3_url, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=LINGER_S)) as ckpt:
            assert ckpt.latest_step() is None and ckpt.steps() == [] and ckpt.memory_step() is None
            assert read_instance(storage) not in (None, old)
            go.touch()
            wait_for(lambda: not running(keeper), "the old keeper to exit")
            assert committed_steps(storage) == []  # step 7 did not go into the new prefix
            ckpt.save_pytree(1, {"x": np.arange(4)})
        assert committed_steps(storage) == [1]
        assert INSTANCE_KEY in [n.rstrip("/") for n in storage.list("")]
    finally:
        if running(keeper):
            os.kill(keeper, signal.SIGKILL)
