#!/usr/bin/env bash
# One call on a GPU machine: build and install, run the test suite, run compute-sanitizer over the
# kernels, and run the benchmark. Stages are chosen by name (default: build test sanitize bench);
# logs go to $OUT (or ./out). Example: bash tools/gpu_run.sh build test bench-quick
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build test sanitize bench)
export PYTHONUNBUFFERED=1
# Hopper only here: one -gencode halves the compile time of a device session.
gencode="-gencode=arch=compute_90a,code=sm_90a"
status=0

run_stage() {
  local name=$1
  shift
  local t0=$SECONDS
  echo "=== $name"
  # At most 8 files come back from a device call: build logs stay in /tmp.
  local log="$out/$name.log"
  case "$name" in *build) log="/tmp/$name.log" ;; esac
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -ne 0 ] && status=1
  return "$rc"
}

for stage in "${stages[@]}"; do
  case "$stage" in
    build)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
      CMAKE_BUILD_PARALLEL_LEVEL=16 run_stage build python3 -m pip install -v \
        --no-build-isolation --no-deps -C "cmake.define.JAX_FLASH_CUDA=ON" \
        -C "cmake.define.JAX_FLASH_CUDA_GENCODE=$gencode" . || exit 1
      ;;
    test)
      run_stage test python3 -m pytest -q -x --durations=20 tests
      ;;
    test-all)
      run_stage test python3 -m pytest -q --durations=20 tests
      ;;
    sanitize)
      nb_dir=$(python3 -m nanobind --cmake_dir)
      run_stage sanitize-build bash -c "cmake -S . -B build/tools -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DJAX_FLASH_CUDA=ON -DJAX_FLASH_TOOLS=ON -Dnanobind_DIR=$nb_dir \
        '-DJAX_FLASH_CUDA_GENCODE=$gencode' -DPython_EXECUTABLE=$(command -v python3) >/dev/null \
        && cmake --build build/tools -j 16 --target sanitize_cases" || continue
      run_stage memcheck compute-sanitizer --tool memcheck --error-exitcode 3 build/tools/sanitize_cases
      run_stage racecheck compute-sanitizer --tool racecheck --error-exitcode 3 build/tools/sanitize_cases
      ;;
    bench-quick)
      run_stage bench python3 benchmarks/bench_attention.py --quick --out "$out/bench"
      ;;
    bench)
      run_stage bench python3 benchmarks/bench_attention.py --out "$out/bench"
      ;;
    *)
      echo "unknown stage $stage" && status=1
      ;;
  esac
done
exit $status
