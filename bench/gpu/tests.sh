#!/usr/bin/env bash
# tests.sh: every packed CUDA test binary (bash .gpu/run.sh), then
# compute-sanitizer memcheck and racecheck over the MoE kernels' tests.
# Build first (here): bash bench/gpu/pack.sh . ./backend/cuda/... ./moe/... ./cmd/gpuctx
# Environment: RUN (a -test.run regexp for the binaries, default all),
# MEMCHECK / RACECHECK (-test.run regexps of the moe tests the sanitizers run),
# LOADED=1: also the layer tests beside another process loading the GPU (the
# soak, 90 s), twice: the check that showed the copy race (bench/RESULTS.md,
# 2026-12-02: 19 and 13 failed subtests without the fix, 0 with it).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
timeout 300 bash .gpu/run.sh > "$OUT/tests-summary.txt" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests-summary.txt"
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -30
echo "== after tests: $(( $(date +%s) - t0 )) s"
san() { # tool regexp
  (cd moe && timeout 120 compute-sanitizer --tool "$1" --error-exitcode 9 ../.gpu/moe.test -test.count=1 -test.v -test.run "$2") > "$OUT/$1.log" 2>&1
  echo "$1 '$2' rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$1.log" | tail -1); $(grep -c -- '--- PASS' "$OUT/$1.log") passed, $(grep -c -- '--- FAIL' "$OUT/$1.log") failed"
  grep -E -A8 "Invalid|Error:|--- FAIL" "$OUT/$1.log" | head -20
}
san memcheck "${MEMCHECK:-TestRouteAlignOneLaunch|TestAlignThreeLaunch|TestLoadLayer|TestLayerSharedRowsEarly/cuda}"
san racecheck "${RACECHECK:-TestLayerFusedTiles/cuda/m16n64k64w1x4s6}"
if [ "${LOADED:-0}" = 1 ]; then
  (cd moe && GPUCTX_SOAK_SHARED=1 GPUCTX_SOAK=90s ../.gpu/moe.test -test.run 'TestSoak$' > "$OUT/loaded-soak.log" 2>&1 & sleep 8
   for r in 1 2; do
     timeout 40 ../.gpu/moe.test -test.count=2 -test.run 'TestLayerDualBitwise/cuda' > "$OUT/loaded-$r.log" 2>&1
     echo "beside a soak, round $r: rc=$? $(grep -c -- '--- FAIL' "$OUT/loaded-$r.log") failed subtests"
   done; wait)
fi
echo "== total $(( $(date +%s) - t0 )) s"
