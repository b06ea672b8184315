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
want restore && { restore_run restore_256M 256M 5; restore_run restore_256M_nofold 256M 5 nofold
                  restore_run restore_1G 1G 5; restore_run restore_1G_nofold 1G 5 nofold
                  restore_run restore_4G 4G 3 "" --lean; }
# the stall: blocking staging (and overlapped), trainer on both cores
want overlap && { overlap_run overlap_1G 1G 5; overlap_run overlap_1G_nofold 1G 5 nofold
                  overlap_run overlap_4G 4G 3; rm -rf /tmp/zsov; }
# issue 16.1: the training dip, 1 GiB and 4 GiB; every 10th persisted
want dip && { for s in none zerostall dcp_async_stager; do dip_run dip_$s $s 1G 3; done
              dip_run dip_zerostall_nofold zerostall 1G 3 nofold
              dip_run dip_zerostall_memtier10 zerostall_memtier10 1G 4
              for s in none zerostall dcp_async_stager; do dip_run dip4G_$s $s 4G 2; done; rm -rf /tmp/zsb; }
# issue 13: restart restore from memory, README order
want restart && run restart $PY benchmarks/memory_restart.py --gib 1 4 --repeats 3 --dir /tmp --open-first
echo "[$(date -u +%T)] done" >> $O/index.txt
