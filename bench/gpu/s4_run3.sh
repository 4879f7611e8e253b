#!/usr/bin/env bash
# Session 4, third call: bulk-copy (cp.async.bulk) and BK=256 tiles, 16-warp
# route_align routing, on the H200. Every CUDA test binary, memcheck over the
# new kernels, then moe bench against the Triton peer for the three target
# presets in the same invocation.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
S="$OUT/summary.txt"
{
timeout 170 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -3 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -20
grep -E -A3 -- '--- FAIL' "$OUT/gpu-tests.log" | head -30
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestRouteAlignOneLaunch|TestLayerFusedTiles/cuda/m(16n32k128w1x2s4t|16n64k64w1x4s6t|32n128k64w1x8s4t|16n32k256w1x2s3)') > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:|FAIL" /tmp/memcheck.log | head -20
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$S" 2>&1
cat "$S"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
row() { grep -E "^\| +[0-9]" "$1"; }
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> "$OUT/bench.log"
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
timeout 120 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> "$OUT/bench.log"
echo "== qwen3-30b-a3b rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-qwen3-30b-a3b.md"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1,64,1024 --mode single,dual,fused,auto --small-batch -1 --iters 20 $P \
  --out "$OUT/moe-deepseek-v3.md" > /dev/null 2>> "$OUT/bench.log"
echo "== deepseek-v3 rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v3.md"; grep -E "^speed vs peer" "$OUT/bench.log"
rm -f "$OUT/triton_moe_anchor.json"
echo "== total $(( $(date +%s) - t0 )) s"
