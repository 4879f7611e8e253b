#!/usr/bin/env bash
# Session 5, after the last benchmark call: the shared warp scan and warpgroup
# epilogue (a refactor; ptxas reports the same registers). The moe and CUDA
# backend test binaries, memcheck over the sorts and the persistent tiles, and
# a DeepSeek-V2-Lite sanity run at 8 and 4096 tokens (no peer).
# Build: bash bench/gpu/pack.sh ./backend/cuda ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -2 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -20
(cd moe && timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run "TestRouteAlignOneLaunch|TestAlignThreeLaunch|TestLayerFusedTiles/cuda/m128n128k64g2s4") > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 8,4096 --mode dual,fused --small-batch -1 --out /tmp/b.md > /dev/null 2>&1
echo "bench rc=$?"; grep -E "^\| +[0-9]" /tmp/b.md
