#!/usr/bin/env bash
# (Run at e72584b, whose kernels ask L2 for the down weights first; that was
# reverted after this call, 07569d0: it made the forwards slower.)
# Session 6, the merged tree on the GPU: early shared rows (e1488d8) and the
# down kernels' L2 prefetch (ef7027b). Every CUDA test binary; memcheck over
# the new test and tiles of both families; the three presets against the
# Triton peer in the same invocation (as s5_final.sh); then the prefetch A/B in
# one CLI (GPUCTX_MOE_PREFETCH_DOWN=0 / 1, alternating, each variant's kernels
# compiled once into a kernel cache).
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
row() { grep -E "^\| +[0-9]" "$1"; }
{
timeout 140 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -3 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -30
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 80 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestLayerSharedRowsEarly/cuda/deepseek-v2-lite|TestLayerFusedTiles/cuda/m(16n64k64w1x4s6|64n64k64g1s4)$') > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1) $(grep -c -- '--- PASS' /tmp/memcheck.log) passed"
grep -E -A8 "Invalid|Error:|FAIL" /tmp/memcheck.log | head -20
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
T0=$t0 bash "$(dirname "$0")/peer3.sh"
export GPUCTX_KERNEL_CACHE=/tmp/kc
for v in 0 1 0 1; do
  [ $(( $(date +%s) - t0 )) -lt 500 ] || { echo "A/B $v skipped: time"; continue; }
  GPUCTX_MOE_PREFETCH_DOWN=$v timeout 40 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,256 --mode fused,dual \
    --small-batch -1 --out "$OUT/pf$v-dsv2.md" > /dev/null 2>&1
  echo "== prefetch $v deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/pf$v-dsv2.md" | cut -c1-90
  GPUCTX_MOE_PREFETCH_DOWN=$v timeout 30 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8 --mode single \
    --small-batch -1 --out "$OUT/pf$v-qwen3.md" > /dev/null 2>&1
  echo "== prefetch $v qwen3 rc=$?"; row "$OUT/pf$v-qwen3.md" | cut -c1-70
done
echo "== total $(( $(date +%s) - t0 )) s"
