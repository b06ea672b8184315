#!/bin/bash
# usage: benchmarks/round4.sh CLONE OUT  -- the fourth round's benchmarks from a fresh clone, one after another
# (run on a quiet machine; docs/performance.md, "Fourth round", quotes OUT/*.log)
C=$1; O=$2; mkdir -p $O; cd $C
export PYTHONPATH=$C/src:$C
PY=${PY:-$C/.venv/bin/python}
run() { name=$1; shift; echo "[$(date -u +%T)] $name: $* (load $(cut -d' ' -f1 /proc/loadavg))" >> $O/index.txt; "$@" > $O/$name.log 2>&1; echo "[$(date -u +%T)] $name rc=$?" >> $O/index.txt; }
# issue 13: restart restore from memory (the first load after adoption: r4premap)
run restart $PY benchmarks/memory_restart.py --gib 1 4 --repeats 3 --dir /tmp
run restart_openfirst $PY benchmarks/memory_restart.py --gib 1 4 --repeats 3 --dir /tmp --open-first
# issue 14: who copies an overlapped save (systems interleaved save by save), 1 GiB and 4 GiB;
# at 4 GiB also with the forward/backward time a model of that size has (--accum)
S=overlap_yield,overlap_normal,blocking
run overlap_1G $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems $S
run overlap_4G $PY -m benchmarks.overlap --size 4G --saves 3 --dir /tmp/zsov --systems $S
run overlap_4G_accum4 $PY -m benchmarks.overlap --size 4G --saves 3 --dir /tmp/zsov --systems $S --accum 4
rm -rf /tmp/zsov
# issue 16.1: the training dip (overlapped saves now reach the writer at the next step)
for s in none zerostall dcp_async_stager; do rm -rf /tmp/zsb; run dip_$s $PY -m benchmarks.dip --system $s --size 1G --dir /tmp/zsb --repeats 3; done
rm -rf /tmp/zsb
echo "[$(date -u +%T)] done" >> $O/index.txt
