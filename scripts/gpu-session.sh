#!/bin/bash
# The GPU checks of a session that the device tool lends a CUDA machine (no network there; its
# python3 has torch with CUDA, pytest, numpy, safetensors, xxhash, but not crc32c).
#
#   scripts/gpu-session.sh prepare       # here, with PyPI: the missing wheels into .whl/ (git-ignored)
#   scripts/gpu-session.sh tests         # there (carry .whl): gputests/ + the overlap unit tests, on CUDA
#   scripts/gpu-session.sh bench [ARGS]  # there (carry .whl): benchmarks/gpu.py ARGS (what make bench-gpu runs)
#   scripts/gpu-session.sh all           # there (carry .whl): tests, bench (3 saves), torn check (50 saves of a
#                                        # small model), the JAX unit tests on the GPU, the loads onto the GPU
#                                        # (gpu_restore.py); each under its own limit (T_TESTS, T_BENCH, T_TORN,
#                                        # T_JAX, T_RESTORE seconds; T_JAX=0 / T_RESTORE=0 leave that part out)
#                                        # so that one call of the device tool (<= 10 min) brings every part back
#   scripts/gpu-session.sh restore [ARGS] # there (carry .whl): the load tests of gputests/, then
#                                        # benchmarks/gpu_restore.py ARGS (loads onto the GPU: zerostall's device
#                                        # pass against its old path, zerostall_host_tmp, and the peers)
#   scripts/gpu-session.sh replicas [ARGS] # there (carry .whl): benchmarks/replicas.py --mib 1024 ARGS, the
#                                        # memory tier's replicas with 1 GiB per rank on a machine with more
#                                        # cores than its 4 trainers and 4 keepers (CPU only; ~5 GiB per rank)
#
# A session's 15 minutes of device time (measured: a start took ~30 s, `all` ~5 min, gpu.py alone
# ~2 min, gpu_restore.py ~2 min) fit `all` in one call, then `bench` (the second consecutive run a
# verdict needs) and `restore` together in a second; give the machine back between analyses.
# `replicas` (estimated 3-5 min at 1 GiB per rank; 2.5 min at 256 MiB on this project's 2-core VM)
# goes in a call of its own, run twice where time allows (a verdict needs two runs).
#
# Results go to $OUT (the device tool brings that folder back), else /tmp/zerostall-gpu. Back here, record
# the figures: python -m benchmarks.history gpu DIR/gpu.json DIR/restore.json --commit C --date D --machine M
# (replicas: python -m benchmarks.history replicas DIR/replicas.json --commit C --date D --machine M)
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
what=${1:-}; shift || true
PYV=${GPU_PYTHON_VERSION:-3.12}
case "$what" in
  prepare)
    ex=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$ex")" || exit 1
    grep -qx '/.whl/' "$ex" 2>/dev/null || echo '/.whl/' >> "$ex"
    mkdir -p .whl
    ${PY:-python3} -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d .whl "crc32c>=2.4" || exit 1
    ls -l .whl
    exit 0 ;;
  tests|bench|all|restore|replicas) ;;
  *) sed -n 2,20p "$0"; exit 2 ;;
esac
out=${OUT:-/tmp/zerostall-gpu}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zs-site .whl/*.whl || exit 1
# the streaming-copy extension (zerostall.memcopy), built in place when a C compiler is there; without
# it every host copy is memmove (env.txt says which)
python3 setup.py -q build_ext --inplace > "$out/build_ext.log" 2>&1 || echo "build_ext failed: see build_ext.log"
export PYTHONPATH=$PWD/src:$PWD:/tmp/zs-site PYTHONUNBUFFERED=1
python3 -c "import torch, zerostall; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" | tee "$out/env.txt"
nvidia-smi >> "$out/env.txt" 2>&1
python3 -c "import zerostall.memcopy as m; print('streaming copies', m.STREAMING)" | tee -a "$out/env.txt"
if [ "$what" = all ]; then
  # one part running long must not take the others' time: each has its own limit (seconds)
  timeout -k 5 "${T_TESTS:-170}" python3 -m pytest -q -p no:cacheprovider -o log_level=WARNING gputests \
    tests/unit/test_overlap.py tests/unit/test_stager.py > "$out/tests.log" 2>&1; echo "tests rc $?" | tee -a "$out/tests.log"
  timeout -k 5 "${T_BENCH:-210}" python3 benchmarks/gpu.py --out "$out/gpu.json" --saves 3 --torn-saves 0 \
    > "$out/bench.log" 2>&1; echo "bench rc $?" | tee -a "$out/bench.log"
  # the torn check is about the guard, not the size: 50 saves per system of a ~0.3 GB state
  timeout -k 5 "${T_TORN:-110}" python3 benchmarks/gpu.py --out "$out/torn.json" --systems "" --torn-saves 50 \
    --layers 4 --d 512 --vocab 8000 --seq 512 --dir /tmp/zsgpu-torn > "$out/torn.log" 2>&1; echo "torn rc $?" | tee -a "$out/torn.log"
  if [ "${T_JAX:-90}" != 0 ]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${T_JAX:-90}" python3 -m pytest -q -p no:cacheprovider \
      tests/unit/test_jax.py > "$out/jax.log" 2>&1; echo "jax rc $?" | tee -a "$out/jax.log"
  fi
  # loads onto the GPU (benchmarks/gpu_restore.py at its defaults); T_RESTORE=0 leaves it out
  if [ "${T_RESTORE:-150}" != 0 ]; then
    timeout -k 5 "${T_RESTORE:-150}" python3 benchmarks/gpu_restore.py --out "$out/restore.json" \
      > "$out/restore.log" 2>&1; echo "restore rc $?" | tee -a "$out/restore.log"
  fi
  tail -n 3 "$out/tests.log" "$out/jax.log" 2>/dev/null; tail -n 8 "$out/bench.log" "$out/torn.log"
  tail -n 12 "$out/restore.log" 2>/dev/null
elif [ "$what" = restore ]; then
  # the loads' own GPU tests first (restore.device: in place, all or nothing, three ways), then the figures
  timeout -k 5 "${T_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider -o log_level=WARNING gputests \
    -k "round_trip or all_or_nothing" > "$out/restore_tests.log" 2>&1; echo "restore tests rc $?" | tee -a "$out/restore_tests.log"
  python3 benchmarks/gpu_restore.py --out "$out/restore.json" "$@" 2>&1 | tee "$out/restore.log"
elif [ "$what" = replicas ]; then
  python3 -m benchmarks.replicas --mib 1024 --out "$out/replicas.json" "$@" 2>&1 | tee "$out/replicas.log"
elif [ "$what" = tests ]; then
  python3 -m pytest -q -p no:cacheprovider -o log_level=WARNING gputests tests/unit/test_overlap.py tests/unit/test_stager.py 2>&1 | tee "$out/tests.log"
else
  python3 benchmarks/gpu.py --out "$out/gpu.json" "$@" 2>&1 | tee "$out/bench.log"
fi
