"""A collective save to a real S3 server (SeaweedFS) from real gloo ranks: the writers use the
trainers' storage environment as it is at each save (credentials, endpoint), not the one they
inherited when they started."""

from __future__ import annotations

import errno
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration"))
import _dist_worker as worker


def test_collective_save_uses_the_trainers_credentials(s3_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = worker.launch(["s3env"], 2, str(tmp_path), env={"ZS_S3_URL": s3_url}, timeout=240)
    for r, res in enumerate(results):
        got = res["s3env"]
        assert got["ok"], f"rank {r}: {got.get('error')}\n{got.get('tb')}"
        (err,) = got["errors"]
        # The wrong secret was the trainer's at save time: every rank's save failed with it...
        assert err is not None and err["type"] == "StorageError" and err["errno"] == errno.EACCES, err
        # ...and with the right one back, the same writers committed step 2 (step 1 never existed).
        assert got["steps"] == [2] and got["same_writer"]
