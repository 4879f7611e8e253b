#!/usr/bin/env bash
# Session 3, call 4: warpgroup tiles prefetching STAGES-1 ahead (a second
# barrier per stage) and the three-launch aligned sort for large batches.
# The moe test binary (TestAlignThreeLaunch on CUDA, every tile against its
# family), memcheck on the new kernels, moe bench with the Triton peer in the
# same invocation (deepseek-v2-lite and qwen3-30b-a3b at 1024/4096), and ncu
# durations of every kernel of one qwen3 forward at 4096 tokens.
# Build: bash bench/gpu/pack.sh ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
S="$OUT/summary.txt"
{
(cd moe && timeout 150 ../.gpu/moe.test -test.count=1 -test.v) > /tmp/moe-tests.log 2>&1
echo "moe tests rc=$? pass=$(grep -c -- '--- PASS' /tmp/moe-tests.log)"; grep -E -- '--- FAIL|panic|bitwise equal|differs' /tmp/moe-tests.log | head -30
grep -E -- "--- (PASS|FAIL|SKIP): TestAlignThreeLaunch" -A3 /tmp/moe-tests.log | head -8
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestAlignThreeLaunch|TestLayerFusedTiles/cuda/m(128n128k64g2s4|192n128k64g3s3|128n256k64g2s3|128n64k64g2s6)') > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:|FAIL" /tmp/memcheck.log | head -30
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$S" 2>&1
cat "$S"
cp /tmp/moe-tests.log "$OUT/moe-tests.log"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
for spec in "deepseek-v2-lite 1024,4096" "qwen3-30b-a3b 1024,4096"; do
  set -- $spec
  timeout 150 .gpu/gpuctx moe bench --preset $1 --tokens $2 --mode single,dual,auto \
    --peer .gpu/peers/triton_fused_moe.py --out "$OUT/$1.md" > /tmp/$1.txt 2>&1
  echo "$1 rc=$?"; grep -E "^\| +[0-9]" "$OUT/$1.md"
  echo "== after $1: $(( $(date +%s) - t0 )) s"
done
timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:gpuctx_moe -c 8 \
  .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 4096 --mode single --small-batch -1 --tile m128n128k64g2s4 --iters 1 --warmup 0 > "$OUT/ncu-stages.txt" 2>&1
echo "== ncu rc=$?"
grep -E "^  [a-zA-Z_]|gpu__time_duration" "$OUT/ncu-stages.txt" | paste - - | awk '{print $1, $(NF-1), $NF}' | head -14
echo "== total $(( $(date +%s) - t0 )) s"
