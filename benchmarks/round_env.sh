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
# The runs round7.sh and round8.sh share. WRAP: empty, or a function that sets a switch for one
# run (nocrc, nofold). restore_run NAME SIZE REPEATS [WRAP [MORE ARGS]]
restore_run() { local n=$1 s=$2 r=$3 w=${4:-}; shift $(( $# < 4 ? $# : 4 )); run $n $w $PY -m benchmarks.restore_ab --size $s --repeats $r --dir /tmp --cold "$@"; }
# overlap_run NAME SIZE SAVES [WRAP]: the stall, blocking and overlapped staging, trainer on both cores
overlap_run() { run $1 ${4:-} $PY -m benchmarks.overlap --size $2 --saves $3 --dir /tmp/zsov --systems overlap,blocking; }
# dip_run NAME SYSTEM SIZE REPEATS [WRAP]: the training dip, from an empty folder
dip_run() { rm -rf /tmp/zsb; run $1 ${5:-} $PY -m benchmarks.dip --system $2 --size $3 --dir /tmp/zsb --repeats $4; }
