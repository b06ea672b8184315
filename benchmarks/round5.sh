#!/bin/bash
# usage: benchmarks/round5.sh CLONE OUT  -- the fifth round's benchmarks from a fresh clone, one after another
# (run on a quiet machine; docs/performance.md, "Fifth round", quotes OUT/*.log)
C=$1; O=$2; mkdir -p $O; cd $C
export PYTHONPATH=$C/src:$C
PY=${PY:-$C/.venv/bin/python}
run() { name=$1; shift; echo "[$(date -u +%T)] $name: $* (load $(cut -d' ' -f1 /proc/loadavg))" >> $O/index.txt; "$@" > $O/$name.log 2>&1; echo "[$(date -u +%T)] $name rc=$?" >> $O/index.txt; }
# issue 13: restart restore from memory (loads now pin the held step: r5keeper)
run restart $PY benchmarks/memory_restart.py --gib 1 4 --repeats 3 --dir /tmp
# issue 14: overlapped vs blocking staging, the trainer on both cores (as every earlier round) and on one
# (--threads 1: a core left to the copier, as a trainer whose compute runs elsewhere)
S=overlap,blocking
run overlap_1G $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems $S
run overlap_1G_t1 $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems $S --threads 1
run overlap_4G_t1 $PY -m benchmarks.overlap --size 4G --saves 3 --dir /tmp/zsov --systems $S --threads 1 --accum 2
rm -rf /tmp/zsov
# issue 16.2: restores, warm and cold (the load path changed for many small leaves: r5leaves)
run restore_1G $PY -m benchmarks.restore_ab --size 1G --repeats 5 --dir /tmp --cold
# many small leaves (r5leaves)
[ -f benchmarks/many_leaves.py ] && run many_leaves $PY benchmarks/many_leaves.py
echo "[$(date -u +%T)] done" >> $O/index.txt
