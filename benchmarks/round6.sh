#!/bin/bash
# usage: [PARTS="restart overlap restore dip"] benchmarks/round6.sh CLONE OUT  -- the sixth round's benchmarks
# from a fresh clone, one after another (PARTS: which of the four groups; all by default)
# (run on a quiet machine; docs/performance.md, "Sixth round", quotes OUT/*.log). The streaming-copy
# extension is built into the clone first; the *_memmove runs set ZEROSTALL_STREAMING_COPY=0 (the same
# code with every copy a memmove: the paired "before").
C=$1; O=$2; PARTS_DEFAULT="restart overlap restore dip"
. "$(dirname "$0")/round_env.sh"
off() { ZEROSTALL_STREAMING_COPY=0 "$@"; }
# issue 13: restart restore from memory, README order
want restart && run restart $PY benchmarks/memory_restart.py --gib 1 4 --repeats 3 --dir /tmp
want restart && run restart_memmove off $PY benchmarks/memory_restart.py --gib 1 --repeats 3 --dir /tmp
# the stall: blocking staging (and overlapped), trainer on both cores
S=overlap,blocking
want overlap && run overlap_1G $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems $S
want overlap && run overlap_1G_memmove off $PY -m benchmarks.overlap --size 1G --saves 3 --dir /tmp/zsov --systems $S
want overlap && run overlap_4G $PY -m benchmarks.overlap --size 4G --saves 3 --dir /tmp/zsov --systems $S
want overlap && rm -rf /tmp/zsov
# issue 16.2: restores, warm and cold
want restore && run restore_256M $PY -m benchmarks.restore_ab --size 256M --repeats 5 --dir /tmp --cold
want restore && run restore_1G $PY -m benchmarks.restore_ab --size 1G --repeats 5 --dir /tmp --cold
want restore && run restore_1G_memmove off $PY -m benchmarks.restore_ab --size 1G --repeats 3 --dir /tmp --cold
want restore && run restore_4G $PY -m benchmarks.restore_ab --size 4G --repeats 3 --dir /tmp --cold
# issue 16.1: the training dip, 1 GiB
want dip && for s in none zerostall dcp_async_stager; do rm -rf /tmp/zsb; run dip_$s $PY -m benchmarks.dip --system $s --size 1G --dir /tmp/zsb --repeats 3; done
want dip && { rm -rf /tmp/zsb; run dip_zerostall_memtier10 $PY -m benchmarks.dip --system zerostall_memtier10 --size 1G --dir /tmp/zsb --repeats 4; }
# ... and 4 GiB
want dip && for s in none zerostall dcp_async_stager; do rm -rf /tmp/zsb; run dip4G_$s $PY -m benchmarks.dip --system $s --size 4G --dir /tmp/zsb --repeats 2; done
want dip && rm -rf /tmp/zsb
echo "[$(date -u +%T)] done" >> $O/index.txt
