# Sourced by benchmarks/round6.sh, round7.sh and round8.sh with C (a fresh clone) and O (the output folder)
# set: build the extension into the clone and define run / want. PARTS_DEFAULT: the groups run
# when PARTS is not set.
mkdir -p $O; cd $C
export PYTHONPATH=$C/src:$C
PY=${PY:-$C/.venv/bin/python}
$PY setup.py -q build_ext --inplace > $O/build_ext.log 2>&1
$PY -c "import zerostall.memcopy as m; print('streaming copies', m.STREAMING, 'copy+crc', m.CRC_COPY)" >> $O/index.txt
run() { name=$1; shift; echo "[$(date -u +%T)] $name: $* (load $(cut -d' ' -f1 /proc/loadavg))" >> $O/index.txt; "$@" > $O/$name.log 2>&1; echo "[$(date -u +%T)] $name rc=$?" >> $O/index.txt; }
want() { [[ " ${PARTS:-$PARTS_DEFAULT} " == *" $1 "* ]]; }
