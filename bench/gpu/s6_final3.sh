#!/usr/bin/env bash
# Session 6, last GPU call: the tree with the early shared rows (e1488d8's
# kernels; the load hints and the down prefetch were measured and reverted)
# and the tuner that times short kernels over several launches. Ends with the
# CLI of e5227b0 (same kernels, the tuner before) against this one on
# FusedShared at 1 and 8 tokens, alternating, twice each.
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
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 110 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" --plot "$OUT/moe-deepseek-v2-lite.png" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
timeout 90 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> /tmp/bench.log
echo "== qwen3-30b-a3b rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-qwen3-30b-a3b.md"
timeout 120 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1,64,1024 --mode single,dual,fused,auto --small-batch -1 --iters 20 $P \
  --out "$OUT/moe-deepseek-v3.md" > /dev/null 2>> /tmp/bench.log
echo "== deepseek-v3 rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v3.md"; grep -E "^speed vs peer|^peer: [0-9]+ " /tmp/bench.log
rm -f "$OUT/triton_moe_anchor.json"
notes() { grep -oE "T=[0-9]+ \(bucket [0-9]+, fused shared true\): up [a-z0-9]+, down [a-z0-9]+, [0-9.]+ us" "$1"; }
if [ -f .gpu/old/gpuctx-e5227b0.gz ]; then
gunzip -c .gpu/old/gpuctx-e5227b0.gz > /tmp/gpuctx-old; chmod +x /tmp/gpuctx-old
for c in /tmp/gpuctx-old .gpu/gpuctx /tmp/gpuctx-old .gpu/gpuctx; do
  timeout 40 $c moe bench --preset deepseek-v2-lite --tokens 1,8 --mode fused --small-batch -1 --out /tmp/b.md > /dev/null 2>&1
  echo "== $c deepseek-v2-lite fused rc=$?"; row /tmp/b.md | cut -c1-100; notes /tmp/b.md
done
fi
echo "== total $(( $(date +%s) - t0 )) s"
