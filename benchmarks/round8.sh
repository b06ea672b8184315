#!/bin/bash
# usage: [PARTS="restore overlap dip restart"] benchmarks/round8.sh CLONE OUT  -- the ninth session's
# benchmarks from a fresh clone, one after another, on a quiet machine. docs/performance.md, "Eighth
# round", quotes OUT/*.log (benchmarks/round6_summary.py OUT prints them). The *_nofold runs set
# ZEROSTALL_CRC_FOLD=0: the same code with the crc32-instruction CRC kernels instead of the
# carry-less-multiply ones (the paired "before" of this round's change).
C=$1; O=$2; PARTS_DEFAULT="restore overlap dip restart"
. "$(dirname "$0")/round_env.sh"
nofold() { ZEROSTALL_CRC_FOLD=0 "$@"; }
# issue 16.2: restores, warm and cold; 4 GiB with --lean (the state freed once saved: it fits in 24 GiB)
want restore && run restore_256M $PY -m benchmarks.restore_ab --size 256M --repeats 5 --dir /tmp --cold
want restore && run restore_256M_nofold nofold $PY -m benchmarks.restore_ab --size 256M --repeats 5 --dir /tmp --cold
want restore && run restore_1G $PY -m benchmarks.restore_ab --size 1G --repeats 5 --dir /tmp --cold
want restore && run restore_1G_nofold nofold $PY -m benchmarks.restore_ab --size 1G --repeats 5 --dir /tmp --cold
want restore && run restore_4G $PY -m benchmarks.restore_ab --size 4G --repeats 3 --dir /tmp --cold --lean
# the stall: blocking staging (and overlapped), trainer on both cores
S=overlap,blocking
want overlap && run overlap_1G $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems $S
want overlap && run overlap_1G_nofold nofold $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems $S
want overlap && run overlap_4G $PY -m benchmarks.overlap --size 4G --saves 3 --dir /tmp/zsov --systems $S
want overlap && rm -rf /tmp/zsov
# issue 16.1: the training dip, 1 GiB and 4 GiB; every 10th persisted
want dip && for s in none zerostall dcp_async_stager; do rm -rf /tmp/zsb; run dip_$s $PY -m benchmarks.dip --system $s --size 1G --dir /tmp/zsb --repeats 3; done
want dip && { rm -rf /tmp/zsb; run dip_zerostall_nofold nofold $PY -m benchmarks.dip --system zerostall --size 1G --dir /tmp/zsb --repeats 3; }
want dip && { rm -rf /tmp/zsb; run dip_zerostall_memtier10 $PY -m benchmarks.dip --system zerostall_memtier10 --size 1G --dir /tmp/zsb --repeats 4; }
want dip && for s in none zerostall dcp_async_stager; do rm -rf /tmp/zsb; run dip4G_$s $PY -m benchmarks.dip --system $s --size 4G --dir /tmp/zsb --repeats 2; done
want dip && rm -rf /tmp/zsb
# issue 13: restart restore from memory, README order
want restart && run restart $PY benchmarks/memory_restart.py --gib 1 4 --repeats 3 --dir /tmp --open-first
echo "[$(date -u +%T)] done" >> $O/index.txt
