#!/usr/bin/env bash
# One call on a GPU machine: build and install, run the test suite, run compute-sanitizer over the
# kernels, and run the benchmarks. Stages are chosen by name (default: build test sanitize bench);
# logs go to $OUT (or ./out). Example: bash tools/gpu_run.sh build test bench-quick; within one
# device call: GPU_RUN_BUDGET=560 bash tools/gpu_run.sh build bench-grid-bf16 bench-det bench-masks
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build test sanitize bench)
export PYTHONUNBUFFERED=1
# The test suite's time is XLA compilation: no GEMM autotuning (the references' matmuls need no
# tuned algorithm to be exact), and one persistent compilation cache that the pytest workers share,
# so a program one worker compiled is loaded by the others. Test stages only: the benchmarks keep
# XLA's defaults.
test_env=(
  XLA_PYTHON_CLIENT_PREALLOCATE=false
  "XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
  "JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_flash_jit_cache}"
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
)
# Hopper only here: one -gencode halves the compile time of a device session. GPU_GENCODE overrides
# it, e.g. "-gencode=arch=compute_90,code=sm_90" for a build without the sm_90a kernels, whose
# suite must then pass on the mma.sync family (the wgmma kernels are compiled to a trap there and
# the host never dispatches them).
gencode="${GPU_GENCODE:--gencode=arch=compute_90a,code=sm_90a}"
status=0
# GPU_RUN_BUDGET=<seconds>: the bench-grid-*, bench-det and bench-masks stages take their time
# limits from what is left of it (a device call's limit), and a stage that would get under 40 s
# is skipped.
budget="${GPU_RUN_BUDGET:-0}"
# Sets `limit` for a benchmark stage: $1 without a budget, else what is left of it less $2 s;
# fails (the stage is skipped) below 40 s.
stage_limit() {
  limit=$1
  [ "$budget" -gt 0 ] && limit=$((budget - SECONDS - $2))
  [ "$limit" -ge 40 ] || { echo "=== $stage: skipped, $limit s left" && return 1; }
}
# pytest under a time limit: SIGINT at the limit, so that pytest still prints its summary of the
# failures so far (a KILL loses it), and at most TEST_MAXFAIL failures, so that a failure that
# breaks a worker's GPU context shows its first tracebacks instead of hundreds of cascaded ones.
pytest_cmd=(
  timeout -s INT -k 30 "${TEST_TIMEOUT:-420}" python3 -m pytest -q -rfEs --tb=short
  --maxfail="${TEST_MAXFAIL:-25}" -n "${TEST_WORKERS:-8}"
)

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

# racecheck over sanitize_cases' selection ($1), one process a case, each log read by
# tools/racecheck_known.py; the logs are concatenated into one on stdout (the device returns few
# files). Fails if any case's racecheck or check fails.
racecheck_each_case() {
  local n rc=0 log=/tmp/racecheck_case.log
  n=$(build/gpu/sanitize_cases "$1" --count) || return 1
  for ((i = 0; i < n; i++)); do
    echo "--- case $i of $n"
    timeout 120 compute-sanitizer --tool racecheck build/gpu/sanitize_cases "$1" --case "$i" \
      > "$log" 2>&1 || rc=1
    cat "$log"
    python3 tools/racecheck_known.py "$log" || rc=1
  done
  return $rc
}

# A standalone driver of a Hopper kernel family: build, run its correctness grid and timings, and
# on a failure rerun its small grid under memcheck.
kernel_check() {
  local name=$1 driver=$2 kernel=$3
  mkdir -p build
  # shellcheck disable=SC2086
  run_stage "$name-build" nvcc -std=c++17 -O3 -lineinfo -I cpp $gencode -DJAX_FLASH_BUILT_SM90A=1 \
    "$driver" "$kernel" \
    cpp/cuda/sm90_host.cu -o "build/$name" &&
    { run_stage "$name" timeout 120 "build/$name" ||
      run_stage "$name-memcheck" timeout 120 compute-sanitizer --tool memcheck --print-limit 20 \
        "build/$name" --quick; }
}

# kernel-checks stands for the three drivers (forward, backward, decode).
expanded=()
for stage in "${stages[@]}"; do
  if [ "$stage" = kernel-checks ]; then
    expanded+=(fwd-check bwd-check decode-check)
  else
    expanded+=("$stage")
  fi
done

for stage in "${expanded[@]}"; do
  case "$stage" in
    build)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
      # A warm device machine keeps the installed wheel between calls: with JAX_FLASH_COMMIT set
      # and the stamp of the last build equal to it (and to the gencode), the build is skipped.
      stamp=/tmp/jax_flash_wheel_stamp
      want="${JAX_FLASH_COMMIT:-} $gencode"
      if [ -n "${JAX_FLASH_COMMIT:-}" ] && [ "$(cat $stamp 2>/dev/null)" = "$want" ]; then
        echo "=== build: the wheel of $want is installed, skipped"
        continue
      fi
      rm -f $stamp
      # The sanitizer driver is built in the same tree, so the kernels compile once.
      CMAKE_BUILD_PARALLEL_LEVEL=16 run_stage build python3 -m pip install -v \
        --no-build-isolation --no-deps -C build-dir=build/gpu -C "cmake.define.JAX_FLASH_CUDA=ON" \
        -C cmake.define.JAX_FLASH_TOOLS=ON -C "cmake.define.JAX_FLASH_CUDA_GENCODE=$gencode" . \
        || exit 1
      echo "$want" > $stamp
      ;;
    test | test-all)
      # The suite is dominated by compiling small programs, so it runs in 8 processes sharing the
      # GPU; each takes memory as it needs it instead of XLA's default 75% up front.
      run_stage test env "${test_env[@]}" "${pytest_cmd[@]}" --durations=10 ${TEST_ARGS:-tests}
      ;;
    test-mma)
      # The mma.sync family, which sm_90 otherwise never runs for 16-bit inputs, and
      # the decode call's cp.async pass (what other GPUs run), over the half-precision tests.
      run_stage test-mma env "${test_env[@]}" JAX_FLASH_CUDA_FAMILY=mma JAX_FLASH_DECODE_COPY=cp.async \
        "${pytest_cmd[@]}" -k "${TEST_MMA_FILTER:-float16 or bfloat16}" tests
      ;;
    sanitize)
      run_stage memcheck timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
        build/gpu/sanitize_cases
      # racecheck takes about 80-300 s over the cases. Its display stops at 100 hazards (a larger
      # --print-limit does not raise that), which the deterministic cases' hand-off record fills
      # when they run together (README, Determinism), and which the other cases' record reached 92
      # of in one process once head_dim 64 and 128 both sent dQ through the writer warps. So the
      # other cases run in two processes (every second case each) and the deterministic ones one
      # case a process, and every log must show nothing but the hand-off record, whose dQ goes
      # through the writer warps (tools/racecheck_known.py fails on anything else or on a cut
      # display).
      for k in 0 1; do
        run_stage "racecheck-$k" timeout 200 compute-sanitizer --tool racecheck \
          build/gpu/sanitize_cases --no-deterministic --shard "$k" 2 &&
          run_stage "racecheck-known-$k" python3 tools/racecheck_known.py "$out/racecheck-$k.log"
      done
      run_stage racecheck-deterministic racecheck_each_case --deterministic-only
      JAX_FLASH_CUDA_FAMILY=mma run_stage memcheck-mma timeout 150 compute-sanitizer \
        --tool memcheck --error-exitcode 3 build/gpu/sanitize_cases
      ;;
    test-persistent)
      # The persistent forward on every call it serves: the suite's calls are small (fewer tiles
      # than SMs), so the grid is capped at 3 CTAs, each running many tiles; then the persistent
      # kernels under racecheck and memcheck the same way.
      run_stage test-persistent env "${test_env[@]}" JAX_FLASH_FWD_PERSISTENT=1 \
        JAX_FLASH_FWD_PERSISTENT_CTAS=3 "${pytest_cmd[@]}" tests
      JAX_FLASH_FWD_PERSISTENT=1 JAX_FLASH_FWD_PERSISTENT_CTAS=3 run_stage racecheck-persistent \
        timeout 150 \
        compute-sanitizer --tool racecheck --kernel-name kns=fwd_wgmma_persistent \
        --error-exitcode 3 build/gpu/sanitize_cases
      JAX_FLASH_FWD_PERSISTENT=1 JAX_FLASH_FWD_PERSISTENT_CTAS=3 run_stage memcheck-persistent \
        timeout 150 \
        compute-sanitizer --tool memcheck --kernel-name kns=fwd_wgmma_persistent \
        --error-exitcode 3 build/gpu/sanitize_cases
      ;;
    test-persistent-sm)
      # The suite with the persistent form on over one CTA per SM (so only calls with more query
      # tiles than SMs run persistent), whatever the build's default.
      run_stage test-persistent-sm env "${test_env[@]}" JAX_FLASH_FWD_PERSISTENT=1 \
        "${pytest_cmd[@]}" tests
      ;;
    fwd-check) kernel_check fwd-wgmma tools/wgmma_check.cu cpp/cuda/fwd_wgmma.cu ;;
    bwd-check) kernel_check bwd-wgmma tools/bwd_wgmma_check.cu cpp/cuda/bwd_wgmma.cu ;;
    decode-check)
      # The decode call's every case on the TMA pass (sm_90's default), then on the cp.async pass
      # and the compact tiles (what other GPUs run), then the TMA pass under the sanitizers.
      kernel_check decode tools/decode_check.cu cpp/cuda/decode.cu &&
        run_stage decode-cp-async env JAX_FLASH_DECODE_COPY=cp.async timeout 120 build/decode &&
        run_stage decode-compact env JAX_FLASH_DECODE_TILES=compact timeout 120 build/decode &&
        run_stage decode-memcheck timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
          build/decode &&
        run_stage decode-racecheck timeout 150 compute-sanitizer --tool racecheck \
          --error-exitcode 3 build/decode
      ;;
    bench-quick)
      run_stage bench python3 benchmarks/bench_attention.py --quick --time-limit 150 \
        --out "$out/bench"
      ;;
    bench-masks)
      # Windows, packed documents, softcap and sinks beside cuDNN and FlashAttention-3. FA3_DIR is
      # the FA3 carry folder (shared/ANCHORS.md), carried to the device as an ignored path; set
      # JAX_FLASH_COMMIT, since the device's copy of the tree has no .git.
      stage_limit "${MASKS_TIME_LIMIT:-230}" 20 || continue
      run_stage bench-masks python3 benchmarks/bench_masks.py --fa3-dir "${FA3_DIR:-fa3_carry}" \
        --time-limit "$limit" --out "$out/bench"
      ;;
    bench-grid-bf16 | bench-grid-fp16)
      # The standard grid (shared/ANCHORS.md) of one dtype beside cuDNN and FlashAttention-3, in
      # what is left of GPU_RUN_BUDGET (default 300 s a stage without one).
      dtype=${stage#bench-grid-}
      stage_limit 300 20 || continue
      run_stage "$stage" python3 benchmarks/bench_attention.py --fa3-dir "${FA3_DIR:-fa3_carry}" \
        --dtypes "$dtype" --impls jax_flash cudnn fa3 --seqlens 1k 4k 16k --no-memory \
        --time-limit "$limit" --out "$out/bench" --name "grid_$dtype"
      ;;
    bench-det)
      # The deterministic backward's cost through JAX (its own repeats; no time limit of its own,
      # so the stage runs under timeout).
      stage_limit 400 10 || continue
      run_stage bench-det timeout "$limit" python3 benchmarks/bench_deterministic.py --repeats 3 \
        --out "$out/bench" --name deterministic
      ;;
    bench)
      # BENCH_ARGS narrows the grid (e.g. "--dtypes bf16 --time-limit 300") to fit one call.
      # shellcheck disable=SC2086
      run_stage bench python3 benchmarks/bench_attention.py ${BENCH_ARGS:-} --out "$out/bench"
      ;;
    *)
      echo "unknown stage $stage" && status=1
      ;;
  esac
done
exit $status
