#!/usr/bin/env bash
# Session 6, last GPU call: the tree with the early shared rows (e1488d8's
# kernels; the load hints and the down prefetch were measured and reverted).
# Every CUDA test binary; memcheck over the early shared rows and the align's
# first segment (two runs: -test.run splits on '/' before '|'); the three
# presets against the Triton peer in the same invocation (as s5_final.sh).
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
for re in 'TestLayerSharedRowsEarly/cuda' 'TestAlignThreeLaunch|TestRouteAlignOneLaunch'; do
  (cd moe && timeout 80 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 -test.v \
    -test.run "$re") > /tmp/memcheck.log 2>&1
  echo "memcheck '$re' rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1); $(grep -c -- '--- PASS' /tmp/memcheck.log) passed, $(grep -c -- '--- FAIL' /tmp/memcheck.log) failed"
  grep -E -A8 "Invalid|Error:|--- FAIL" /tmp/memcheck.log | head -20
done
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
T0=$t0 bash "$(dirname "$0")/peer3.sh"
echo "== total $(( $(date +%s) - t0 )) s"
