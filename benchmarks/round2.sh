#!/bin/bash
# usage: benchmarks/round2.sh CLONE OUT  -- the round's benchmarks from a fresh clone, one after another
C=$1; O=$2; mkdir -p $O; cd $C
export PYTHONPATH=$C/src:$C
PY=${PY:-$C/.venv/bin/python}
run() { name=$1; shift; echo "[$(date -u +%T)] $name: $*" >> $O/index.txt; "$@" > $O/$name.log 2>&1; echo "[$(date -u +%T)] $name rc=$?" >> $O/index.txt; }
run memtier $PY benchmarks/memory_tier.py --gib 1 4 --repeats 3 --dir /tmp
run restart $PY benchmarks/memory_restart.py --gib 1 4 --repeats 3 --dir /tmp
run restore $PY -m benchmarks.restore_ab --size 1G --repeats 5 --dir /tmp --cold
run steal $PY benchmarks/steal_probe.py --gib 1 --repeats 3 --dir /tmp
for s in none zerostall dcp_async_stager; do rm -rf /tmp/zsb; run dip_$s $PY -m benchmarks.dip --system $s --size 1G --dir /tmp/zsb --repeats 3; done
rm -rf /tmp/zsb; run dip_zerostall_memtier10 $PY -m benchmarks.dip --system zerostall_memtier10 --size 1G --dir /tmp/zsb --repeats 6
rm -rf /tmp/zsb
run overlap $PY -m benchmarks.overlap --size 1G --saves 5 --dir /tmp/zsov --systems overlap,blocking
echo "[$(date -u +%T)] done" >> $O/index.txt
