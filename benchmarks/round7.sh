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
S=overlap,blocking
want overlap && run overlap_1G $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems $S
want overlap && run overlap_1G_nocrc nocrc $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems $S
want overlap && run overlap_4G $PY -m benchmarks.overlap --size 4G --saves 3 --dir /tmp/zsov --systems $S
want overlap && rm -rf /tmp/zsov
# issue 16.1: the training dip, 1 GiB; issue 13: every 10th persisted
want dip && for s in none zerostall dcp_async_stager; do rm -rf /tmp/zsb; run dip_$s $PY -m benchmarks.dip --system $s --size 1G --dir /tmp/zsb --repeats 3; done
want dip && { rm -rf /tmp/zsb; run dip_zerostall_nocrc nocrc $PY -m benchmarks.dip --system zerostall --size 1G --dir /tmp/zsb --repeats 3; }
want dip && { rm -rf /tmp/zsb; run dip_zerostall_memtier10 $PY -m benchmarks.dip --system zerostall_memtier10 --size 1G --dir /tmp/zsb --repeats 4; }
want dip && { rm -rf /tmp/zsb; run dip_zerostall_memtier10_nocrc nocrc $PY -m benchmarks.dip --system zerostall_memtier10 --size 1G --dir /tmp/zsb --repeats 4; }
# ... and 4 GiB
want dip && for s in none zerostall dcp_async_stager; do rm -rf /tmp/zsb; run dip4G_$s $PY -m benchmarks.dip --system $s --size 4G --dir /tmp/zsb --repeats 2; done
want dip && rm -rf /tmp/zsb
# issue 16.2: restores, warm and cold; 4 GiB with --lean (the state freed once saved: it fits in 24 GiB)
want restore && run restore_256M $PY -m benchmarks.restore_ab --size 256M --repeats 5 --dir /tmp --cold
want restore && run restore_1G $PY -m benchmarks.restore_ab --size 1G --repeats 5 --dir /tmp --cold
want restore && run restore_4G $PY -m benchmarks.restore_ab --size 4G --repeats 3 --dir /tmp --cold --lean
echo "[$(date -u +%T)] done" >> $O/index.txt
