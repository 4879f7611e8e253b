#!/usr/bin/env bash
# Session 3, final GPU run of the merged tree: every CUDA test binary, memcheck
# on the warpgroup tiles and the three-launch align, moe bench against the
# Triton fused-MoE peer in the same invocation for the three target presets
# (bench/RESULTS.md), then the 5-minute soak (issue 7; NOSOAK=1 leaves it out).
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
S="$OUT/summary.txt"
{
timeout 150 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -3 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -- '--- FAIL|panic|bitwise equal|differs' "$OUT/gpu-tests.log" | head -20
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestAlignThreeLaunch|TestLayerFusedTiles/cuda/m(128n64k64g2s3|128n128k64g2s4|192n256k64g3s3)') > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:|FAIL" /tmp/memcheck.log | head -20
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$S" 2>&1
cat "$S"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
row() { grep -E "^\| +[0-9]" "$1"; }
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" --plot "$OUT/moe-deepseek-v2-lite.png" > /dev/null 2> "$OUT/bench.log"
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
timeout 120 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> "$OUT/bench.log"
echo "== qwen3-30b-a3b rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-qwen3-30b-a3b.md"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1,64,1024 --mode single,dual,fused,auto --small-batch -1 --iters 20 $P \
  --out "$OUT/moe-deepseek-v3.md" > /dev/null 2>> "$OUT/bench.log"
echo "== deepseek-v3 rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v3.md"; grep -E "^speed vs peer" "$OUT/bench.log"
rm -f "$OUT/triton_moe_anchor.json"  # eight files come back at most
[ -n "${NOSOAK:-}" ] || {
  (cd moe && GPUCTX_SOAK=5m timeout 340 ../.gpu/moe.test -test.count=1 -test.v -test.timeout 335s -test.run 'TestSoak$') > /tmp/soak.log 2>&1
  echo "soak rc=$?"; grep -E "soak|phase|--- " /tmp/soak.log | head -12; cp /tmp/soak.log "$OUT/soak.log"
}
echo "== total $(( $(date +%s) - t0 )) s"
