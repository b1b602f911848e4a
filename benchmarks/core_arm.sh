#!/usr/bin/env bash
# The kernel core's NEON paths on real ARM hardware (qemu checks they are exact, not how fast they are).
#
#   bash benchmarks/core_arm.sh build        # here (x86): cross-builds build/aarch64-bench, static, no hosts
#   bash benchmarks/core_arm.sh run [FILE]   # on an aarch64 Linux machine (copy the repo's benchmarks/ and
#                                            # build/aarch64-bench there; the binaries need no libraries)
#
# run: the core's own tests on that CPU (every path against the scalar one), then one decode step
# (toolkit/csrc/pagedkv_core_bench: default spec, random codes, shuffled blocks) per path, SmolLM2 dims
# 9/3/64 and 32/8/128, ctx 4K and 16K, 1/2/4 threads, beside the memory floor of the same step
# (BENCH_WALK=1: the step's pool bytes read in the kernel's order, no arithmetic). Prints a markdown
# table (also to FILE): ms per step, GB/s of KV read, and floor / step (1.0 = the step runs at the speed
# of reading its bytes).
set -euo pipefail
cd "$(dirname "$0")/.."
B=build/aarch64-bench

case "${1:-}" in
build)
  cmake -S toolkit/csrc -B "$B" -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ -DPAGEDKV_BUILD_ET=OFF -DPAGEDKV_BUILD_ORT=OFF \
    -DCMAKE_EXE_LINKER_FLAGS=-static >/dev/null
  cmake --build "$B" -j"$(nproc)" --target pagedkv_core_bench pagedkv_core_test >/dev/null
  echo "built $B/pagedkv_core_bench and $B/pagedkv_core_test (aarch64, static)"
  ;;
run)
  out=${2:-/dev/null}
  [ "$(uname -m)" = aarch64 ] || { echo "core_arm.sh run: needs an aarch64 machine (this is $(uname -m))" >&2; exit 2; }
  cpu=$( (lscpu 2>/dev/null || true) | sed -n 's/^Model name: *//p' | sort -u | paste -sd/ -)
  [ -n "$cpu" ] || cpu="CPU parts $(sed -n 's/^CPU part[^:]*: *//p' /proc/cpuinfo | sort -u | paste -sd' ' -)"
  echo "CPU: $cpu ($(nproc) cores), features: $(grep -m1 -o -w -E 'asimddp|i8mm|sve|sve2' /proc/cpuinfo | sort -u | paste -sd' ' -)" | tee "$out"
  "$B/pagedkv_core_test" 2>&1 | tail -2 | tee -a "$out"
  paths=$("$B/pagedkv_core_bench" --paths)
  echo "| path | Hq/Hkv/D | ctx | threads | ms | GB/s | floor ms | floor / step |" | tee -a "$out"
  echo "|---|---|---:|---:|---:|---:|---:|---:|" | tee -a "$out"
  for dims in "9 3 64" "32 8 128"; do
    for ctx in 4096 16384; do
      reps=$(( 2000000 / ctx )); reps=$(( reps < 20 ? 20 : (reps > 400 ? 400 : reps) ))
      for t in 1 2 4; do
        floor=$(BENCH_WALK=1 "$B/pagedkv_core_bench" "$ctx" $dims "$t" "$reps" | sed -E 's/.*: +([0-9.]+) ms.*/\1/')
        for p in $paths; do
          line=$("$B/pagedkv_core_bench" "$ctx" $dims "$t" "$reps" "$p")
          ms=$(echo "$line" | sed -E 's/.*: +([0-9.]+) ms.*/\1/')
          gbs=$(echo "$line" | sed -E 's/.* ms +([0-9.]+) GB\/s.*/\1/')
          echo "| $p | ${dims// //} | $ctx | $t | $ms | $gbs | $floor | $(awk -v f="$floor" -v m="$ms" 'BEGIN{printf "%.2f", f/m}') |" | tee -a "$out"
        done
      done
    done
  done
  ;;
*)
  echo "usage: bash benchmarks/core_arm.sh build | run [FILE]" >&2
  exit 2
  ;;
esac
