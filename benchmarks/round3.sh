#!/bin/bash
# usage: benchmarks/round3.sh CLONE OUT  -- the third round's benchmarks from a fresh clone, one after another
# (run on a quiet machine; docs/performance.md, "Third round", quotes OUT/*.log)
C=$1; O=$2; mkdir -p $O; cd $C
export PYTHONPATH=$C/src:$C
PY=${PY:-$C/.venv/bin/python}
run() { name=$1; shift; echo "[$(date -u +%T)] $name: $* (load $(cut -d' ' -f1 /proc/loadavg))" >> $O/index.txt; "$@" > $O/$name.log 2>&1; echo "[$(date -u +%T)] $name rc=$?" >> $O/index.txt; }
# issue 13: restart restore from memory, the live trainer's keeper
run restart $PY benchmarks/memory_restart.py --gib 1 4 --repeats 3 --dir /tmp
run memtier $PY benchmarks/memory_tier.py --gib 1 4 --repeats 3 --dir /tmp
run memtier_stall $PY benchmarks/memtier_stall_ab.py --gib 1 4 --saves 24 8 --interval 3 --dir /tmp
run dip_cost $PY benchmarks/dip_cost.py --gib 1 --saves 6 --dir /tmp
# issue 16.2: restores, warm and cold, three sizes
for s in 256M 1G; do run restore_$s $PY -m benchmarks.restore_ab --size $s --repeats 5 --dir /tmp --cold; done
run restore_4G $PY -m benchmarks.restore_ab --size 4G --repeats 3 --dir /tmp --cold
# issue 14: overlapped staging (systems interleaved save by save), 1 GiB and 4 GiB
run overlap_1G $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems overlap,overlap_normal,blocking
run overlap_4G $PY -m benchmarks.overlap --size 4G --saves 3 --dir /tmp/zsov --systems overlap,overlap_normal,blocking
rm -rf /tmp/zsov
# issue 16.1 and 13: the training dip
for s in none zerostall dcp_async_stager; do rm -rf /tmp/zsb; run dip_$s $PY -m benchmarks.dip --system $s --size 1G --dir /tmp/zsb --repeats 3; done
rm -rf /tmp/zsb; run dip_zerostall_memtier10 $PY -m benchmarks.dip --system zerostall_memtier10 --size 1G --dir /tmp/zsb --repeats 6
rm -rf /tmp/zsb
echo "[$(date -u +%T)] done" >> $O/index.txt
