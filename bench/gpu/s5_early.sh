#!/usr/bin/env bash
# Session 5, first GPU call (commit f2a4e20): early (programmatic dependent)
# launches of the fused path and routing in registers. Every CUDA test binary
# (TestLaunchEarly among them), memcheck over the routing and early-launch
# tests, then DeepSeek-V2-Lite against the Triton peer twice in the same call:
# with early launches (the default) and without (GPUCTX_EARLY_LAUNCH=0), and
# ncu's per-kernel durations of one graph-replayed forward at 8 tokens.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
S="$OUT/summary.txt"
{
timeout 200 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -3 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -30
grep -E -A2 -- '--- (PASS|FAIL|SKIP): TestLaunchEarly' "$OUT/gpu-tests.log" | head -12
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run "TestRouteAlignOneLaunch|TestRouteKernelTies|TestAlignThreeLaunch|TestLayerFusedTiles/cuda/m16n16k128") > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:|FAIL" /tmp/memcheck.log | head -20
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$S" 2>&1
cat "$S"
row() { grep -E "^\| +[0-9]" "$1"; }
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite early rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
GPUCTX_EARLY_LAUNCH=0 timeout 100 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode dual,fused,auto \
  --small-batch -1 --out "$OUT/moe-deepseek-v2-lite-noearly.md" > /dev/null 2>> /tmp/bench.log
echo "== deepseek-v2-lite GPUCTX_EARLY_LAUNCH=0 rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite-noearly.md"
grep -E "^speed vs peer|^peer: [0-9]+ |rror" /tmp/bench.log | head
rm -f "$OUT/triton_moe_anchor.json"
timeout 90 ncu --clock-control none --launch-count 40 --section SpeedOfLight \
  .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 8 --mode fused --small-batch -1 --tile m16n16k128w1x1s4 --iters 3 --warmup 1 > /tmp/ncu8.txt 2>&1
echo "ncu rc=$?"; grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput" /tmp/ncu8.txt | paste - - - | awk '{print $1, $(NF-4), $(NF-3), $NF}' | head -40
echo "== total $(( $(date +%s) - t0 )) s"
