#!/bin/bash
# usage: [PARTS="restart overlap dip restore"] benchmarks/round7.sh CLONE OUT  -- the seventh round's benchmarks
# from a fresh clone, one after another (PARTS: which groups; all by default), on a quiet machine.
# docs/performance.md, "Seventh round", quotes OUT/*.log (benchmarks/round6_summary.py OUT prints
# them). The *_nocrc runs set ZEROSTALL_STAGE_CRC=0: the same code with the writer (or keeper)
# checksumming every leaf, as before checksums at staging (the paired "before").
C=$1; O=$2; PARTS_DEFAULT="restart overlap dip restore"
. "$(dirname "$0")/round_env.sh"
nocrc() { ZEROSTALL_STAGE_CRC=0 "$@"; }
# issue 13: restart restore from memory, README order
want restart && run restart $PY benchmarks/memory_restart.py --gib 1 4 --repeats 3 --dir /tmp
# the stall: blocking staging (and overlapped), trainer on both cores; with and without checksums at staging
want overlap && { overlap_run overlap_1G 1G 5; overlap_run overlap_1G_nocrc 1G 5 nocrc
                  overlap_run overlap_4G 4G 3; rm -rf /tmp/zsov; }
# issue 16.1: the training dip, 1 GiB; issue 13: every 10th persisted; ... and 4 GiB
want dip && { for s in none zerostall dcp_async_stager; do dip_run dip_$s $s 1G 3; done
              dip_run dip_zerostall_nocrc zerostall 1G 3 nocrc
              dip_run dip_zerostall_memtier10 zerostall_memtier10 1G 4
              dip_run dip_zerostall_memtier10_nocrc zerostall_memtier10 1G 4 nocrc
              for s in none zerostall dcp_async_stager; do dip_run dip4G_$s $s 4G 2; done; rm -rf /tmp/zsb; }
# issue 16.2: restores, warm and cold; 4 GiB with --lean (the state freed once saved: it fits in 24 GiB)
want restore && { restore_run restore_256M 256M 5; restore_run restore_1G 1G 5; restore_run restore_4G 4G 3 "" --lean; }
echo "[$(date -u +%T)] done" >> $O/index.txt
