#!/usr/bin/env bash
# Builds one standalone kernel driver from several source trees and runs the builds back to back in
# one device call, so that kernel versions are compared on the same machine (a fresh device machine
# per call can differ by several percent). A tree is a directory holding cpp/ and tools/ (`.` for
# this checkout; another version is materialised before the call, e.g.
# `git archive <rev> cpp tools | tar -x -C exp_new`), optionally followed by `:` and extra nvcc
# flags (an experiment's -D switches).
#
# Usage: bash tools/ab_driver.sh DRIVER KERNEL "DRIVER_ARGS" TREE[:FLAGS] TREE[:FLAGS] ...
# (KERNEL `-`: the driver holds its kernels itself.)
#   bash tools/ab_driver.sh tools/wgmma_check.cu cpp/cuda/fwd_wgmma.cu --time \
#       . exp_new exp_new:-DJAX_FLASH_FWD_STORE_4B
# Each build's output goes to $OUT/ab_<n>.txt (n = the tree's position); the table printed at the
# end puts every rate line (TFLOP/s or GB/s) of the builds side by side, with each build's ratio
# to the first. AB_ROUNDS=R (default 1) runs the builds back to back R times, round by round, so
# that a difference can be told from the machine's drift: the outputs are then
# $OUT/ab_<n>_r<round>.txt and a table is printed per round. AB_STAGE=build builds and stops;
# AB_STAGE=run times the builds an earlier AB_STAGE=build left in build/ (same specs), so that the
# compilation can overlap other work while the timed rounds run on an otherwise idle machine.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out" build
driver=$1
kernel=$2
args=$3
shift 3
specs=("$@")
gencode="${GPU_GENCODE:--gencode=arch=compute_90a,code=sm_90a}"
[ "$kernel" = - ] && kernel=""
stage="${AB_STAGE:-all}"
n=0
pids=()
for spec in "$@"; do
  if [ "$stage" = run ]; then
    [ -x "build/ab_$n" ] || { echo "build/ab_$n missing: run AB_STAGE=build first" && exit 1; }
    n=$((n + 1))
    continue
  fi
  tree=${spec%%:*}
  flags=""
  [ "$tree" != "$spec" ] && flags=${spec#*:}
  # shellcheck disable=SC2086
  (cd "$tree" && nvcc -std=c++17 -O3 -lineinfo -I cpp $gencode -DJAX_FLASH_BUILT_SM90A=1 $flags \
    "$driver" $kernel cpp/cuda/sm90_host.cu -o "$OLDPWD/build/ab_$n") > "/tmp/ab_build_$n.log" 2>&1 &
  pids+=($!)
  n=$((n + 1))
done
status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "build $i (${specs[$i]}) failed:" && tail -20 "/tmp/ab_build_$i.log"
    status=1
  fi
done
[ $status -ne 0 ] && exit $status
[ "$stage" = build ] && exit 0
rounds="${AB_ROUNDS:-1}"
for ((r = 1; r <= rounds; r++)); do
  for ((i = 0; i < n; i++)); do
    suffix=""
    [ "$rounds" -gt 1 ] && suffix="_r$r"
    echo "=== round $r, build $i: ${specs[$i]}"
    # shellcheck disable=SC2086
    timeout "${AB_TIMEOUT:-300}" "build/ab_$i" $args > "$out/ab_$i$suffix.txt" 2>&1
    echo "exit $?"
  done
done
python3 - "$out" "$n" "$rounds" "$@" <<'PY'
import re
import sys

out, n, rounds, specs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
rate = re.compile(r"^(.*?)\s+([\d.]+) (?:ms|us),?\s+([\d.]+) (TFLOP/s|GB/s)")
print("builds: " + "  ".join(f"[{i}] {s}" for i, s in enumerate(specs)))
for r in range(1, rounds + 1):
    suffix = f"_r{r}" if rounds > 1 else ""
    runs = []
    for i in range(n):
        rows = []
        with open(f"{out}/ab_{i}{suffix}.txt") as f:
            for line in f:
                m = rate.search(line)
                if m:
                    rows.append((m.group(1).strip(), float(m.group(3))))
        runs.append(rows)
    if rounds > 1:
        print(f"round {r}:")
    for j, (label, first) in enumerate(runs[0]):
        cells = [f"{first:8.1f}"]
        for rows in runs[1:]:
            if j < len(rows) and rows[j][0] == label:
                cells.append(f"{rows[j][1]:8.1f} x{rows[j][1] / first:5.3f}")
            else:
                cells.append("       -       ")
        print(f"{label[:60]:60s} " + "  ".join(cells))
PY
