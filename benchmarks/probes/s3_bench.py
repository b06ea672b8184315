#!/usr/bin/env python3
"""zerostall against S3 vs raw boto3 on the same bytes, in the same run.

Starts a local SeaweedFS through ``scripts/s3-local.sh`` (or uses the server in the
environment with ``--use-env``), then, interleaving the contenders in every repetition:

* persist: ``Checkpointer.save_pytree`` (default PROCESS writer) -> the writer's persist time
  (upload + checksums + manifest commit), and the caller's wall time to ``result()``;
* raw upload: boto3 ``upload_fileobj`` (TransferConfig with the same part size and concurrency)
  and a plain ``put_object`` of the same bytes;
* restore: ``load_pytree`` into a preallocated template (in place, checksums verified, and not);
* raw download: boto3 ``download_fileobj`` into a preallocated buffer and ``get_object().read()``.

Prints MiB/s (median of the repetitions) and zerostall's ratio to the best raw boto3 figure.

    .venv/bin/python benchmarks/probes/s3_bench.py --mib 256 --reps 3

What it showed (a 2-core machine shared with other test suites, SeaweedFS on loopback, five
runs): persist at parity with raw boto3 (0.84-1.45x of the better raw contender), restore
without verification at parity (0.92-1.58x), restore with verification 0.66-1.13x (the CRC32C
pass shows when the two cores are saturated). Figures and reading: docs/storage.md, "Measured
numbers".
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "src"))

MiB = 1 << 20


def start_server() -> tuple[str, dict[str, str]]:
    d = tempfile.mkdtemp(prefix="zs-s3-bench-")
    subprocess.run([os.path.join(REPO, "scripts", "s3-local.sh"), "start", d, "0"], check=True,
                   stdout=subprocess.PIPE, text=True)
    env = {}
    for line in open(os.path.join(d, "env.sh")):
        m = re.match(r"export (\w+)='(.*)'$", line.strip())
        if m:
            env[m.group(1)] = m.group(2)
    return d, env


class _Into(io.RawIOBase):
    """A writable file over a preallocated buffer (download_fileobj into memory, no growth)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[no-untyped-def]
        n = len(b)
        self.view[self.pos:self.pos + n] = b
        self.pos += n
        return n

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = off if whence == 0 else self.pos + off
        return self.pos

    def tell(self) -> int:
        return self.pos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--part-mib", type=int, default=32, help="part size for both contenders (default 32)")
    ap.add_argument("--concurrency", type=int, default=8, help="parallel parts for both (default 8)")
    ap.add_argument("--writer-nice", type=int, default=None,
                    help="niceness of the writer process (default: SaveOptions' 10, which yields CPU to "
                         "training and, on a loaded machine, to everything else)")
    ap.add_argument("--use-env", action="store_true", help="use the S3 server of the AWS_* environment")
    ap.add_argument("--bucket", default=None)
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = ap.parse_args()

    datadir = None
    if not args.use_env:
        datadir, env = start_server()
        os.environ.update(env)
    os.environ["ZEROSTALL_S3_PART_SIZE"] = str(args.part_mib * MiB)
    os.environ["ZEROSTALL_S3_CONCURRENCY"] = str(args.concurrency)
    try:
        return run(args)
    finally:
        if datadir:
            subprocess.run([os.path.join(REPO, "scripts", "s3-local.sh"), "stop", datadir],
                           stderr=subprocess.DEVNULL)
            shutil.rmtree(datadir, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    import boto3
    import torch
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    import zerostall
    from zerostall.options import LoadOptions, SaveOptions

    bucket = args.bucket or f"zs-bench-{uuid.uuid4().hex[:6]}"
    client = boto3.session.Session().client("s3", config=Config(max_pool_connections=32))
    if args.bucket is None:
        client.create_bucket(Bucket=bucket)
        while True:
            try:
                client.head_bucket(Bucket=bucket)
                break
            except Exception:
                time.sleep(0.05)
    tcfg = TransferConfig(multipart_threshold=args.part_mib * MiB, multipart_chunksize=args.part_mib * MiB,
                          max_concurrency=args.concurrency, use_threads=True)

    n = args.mib * MiB
    state = {"w": torch.randint(0, 256, (n,), dtype=torch.uint8)}
    raw = state["w"].numpy().tobytes()
    template = {"w": torch.empty(n, dtype=torch.uint8)}
    sink = bytearray(n)
    res: dict[str, list[float]] = {k: [] for k in (
        "zs_persist", "zs_save_wall", "raw_upload_fileobj", "raw_put_object",
        "zs_restore_verify", "zs_restore_noverify", "raw_download_fileobj", "raw_get_object")}
    nbytes = 0
    url = f"s3://{bucket}/run-{uuid.uuid4().hex[:6]}"
    save_options = SaveOptions() if args.writer_nice is None else SaveOptions(writer_nice=args.writer_nice)
    with zerostall.Checkpointer(url, keep_last=1, save_options=save_options) as ckpt:
        ckpt.save_pytree(0, {"w": torch.zeros(1 << 20, dtype=torch.uint8)})  # warm up writer + client
        for rep in range(1, args.reps + 1):
            key = f"raw/{rep}"
            t = time.perf_counter()
            client.upload_fileobj(io.BytesIO(raw), bucket, key + "-a", Config=tcfg)
            res["raw_upload_fileobj"].append(n / (time.perf_counter() - t))
            t = time.perf_counter()
            client.put_object(Bucket=bucket, Key=key + "-b", Body=raw)
            res["raw_put_object"].append(n / (time.perf_counter() - t))

            t = time.perf_counter()
            stats = ckpt.save_pytree_async(rep, state).result()
            res["zs_save_wall"].append(n / (time.perf_counter() - t))
            res["zs_persist"].append(n / stats.persist_s)  # type: ignore[operator]
            nbytes = stats.nbytes

            t = time.perf_counter()
            client.download_fileobj(bucket, key + "-a", _Into(memoryview(sink)), Config=tcfg)
            res["raw_download_fileobj"].append(n / (time.perf_counter() - t))
            t = time.perf_counter()
            client.get_object(Bucket=bucket, Key=key + "-b")["Body"].read()
            res["raw_get_object"].append(n / (time.perf_counter() - t))

            t = time.perf_counter()
            ckpt.load_pytree(rep, template)
            res["zs_restore_verify"].append(n / (time.perf_counter() - t))
            t = time.perf_counter()
            zerostall.load_pytree(f"{url}/step_{rep:08d}", template, options=LoadOptions(verify=False))
            res["zs_restore_noverify"].append(n / (time.perf_counter() - t))
            assert torch.equal(template["w"], state["w"])
            client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": key + "-a"}, {"Key": key + "-b"}]})

    med = {k: statistics.median(v) / MiB for k, v in res.items()}
    # Ratios are taken per repetition (contenders ran back to back) and then the median: on a
    # shared machine the load drifts between repetitions more than between neighbours.
    up_ratio = [z / max(a, b) for z, a, b in zip(res["zs_persist"], res["raw_upload_fileobj"], res["raw_put_object"])]
    wall_ratio = [z / max(a, b) for z, a, b in zip(res["zs_save_wall"], res["raw_upload_fileobj"],
                                                     res["raw_put_object"])]
    down_ratio = [z / max(a, b) for z, a, b in zip(res["zs_restore_verify"], res["raw_download_fileobj"],
                                                     res["raw_get_object"])]
    down_nv_ratio = [z / max(a, b) for z, a, b in zip(res["zs_restore_noverify"], res["raw_download_fileobj"],
                                                        res["raw_get_object"])]
    print(f"S3 benchmark: {args.mib} MiB state ({nbytes / MiB:.1f} MiB written), {args.reps} reps, "
          f"part {args.part_mib} MiB, concurrency {args.concurrency}, writer nice {save_options.writer_nice}, "
          f"load average {os.getloadavg()[0]:.1f}, endpoint {os.environ.get('AWS_ENDPOINT_URL')}")
    print(f"{'contender':28s} {'median MiB/s':>12s}  {'all reps':s}")
    for k, v in res.items():
        print(f"{k:28s} {med[k]:12.0f}  {' '.join(f'{x / MiB:.0f}' for x in v)}")
    r = statistics.median
    print(f"persist / best raw upload, median of per-rep ratios:   {r(up_ratio):.2f}x "
          f"(save wall {r(wall_ratio):.2f}x; reps {' '.join(f'{x:.2f}' for x in up_ratio)})")
    print(f"restore / best raw download, median of per-rep ratios: {r(down_ratio):.2f}x verified, "
          f"{r(down_nv_ratio):.2f}x unverified (reps {' '.join(f'{x:.2f}' for x in down_ratio)})")
    if args.json:
        print(json.dumps({"mib": args.mib, "reps": args.reps, "median_mib_s": med, "persist_ratio": r(up_ratio),
                          "restore_ratio": r(down_ratio), "restore_unverified_ratio": r(down_nv_ratio)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
