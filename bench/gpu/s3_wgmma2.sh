#!/usr/bin/env bash
# Session 3, call 3: the larger warpgroup tiles (BM 192 with 3 warpgroups,
# down-only BN 256). The moe test binary (every tile against its family's
# reference and the float64 reference), memcheck on the new tiles, moe bench
# with the Triton peer in the same invocation (deepseek-v2-lite and
# qwen3-30b-a3b at 1024/4096, deepseek-v3 at 1024), and ncu (speed of light,
# L2, tensor pipe) on the up and down kernels of m192n128k64g3s4 at 4096.
# Build: bash bench/gpu/pack.sh ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
S="$OUT/summary.txt"
{
(cd moe && timeout 150 ../.gpu/moe.test -test.count=1 -test.v) > /tmp/moe-tests.log 2>&1
echo "moe tests rc=$? pass=$(grep -c -- '--- PASS' /tmp/moe-tests.log)"; grep -E -- '--- FAIL|panic|bitwise equal' /tmp/moe-tests.log | head -30
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestLayerFusedTiles/cuda/m(192n128k64g3s[34]|128n256k64g2s4|192n256k64g3s3)') > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:|FAIL" /tmp/memcheck.log | head -30
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$S" 2>&1
cat "$S"
cp /tmp/moe-tests.log "$OUT/moe-tests.log"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
for spec in "deepseek-v2-lite 1024,4096" "qwen3-30b-a3b 1024,4096" "deepseek-v3 1024"; do
  set -- $spec
  timeout 150 .gpu/gpuctx moe bench --preset $1 --tokens $2 --mode single,dual,auto \
    --peer .gpu/peers/triton_fused_moe.py --out "$OUT/$1.md" > /tmp/$1.txt 2>&1
  echo "$1 rc=$?"; tail -3 /tmp/$1.txt | head -1; grep -E "^\| +[0-9]" "$OUT/$1.md"
  echo "== after $1: $(( $(date +%s) - t0 )) s"
done
NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis"
timeout 100 $NCU -k regex:'gpuctx_moe_(up|down)' --launch-skip 2 --launch-count 2 \
  .gpu/gpuctx moe bench --tokens 4096 --mode single --small-batch -1 --tile m192n128k64g3s4 --iters 2 --warmup 1 \
  > "$OUT/ncu-4096.txt" 2>&1
echo "== ncu rc=$?"
grep -E "gpuctx_moe_(up|down)|Duration|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Tensor is|L2 Hit" "$OUT/ncu-4096.txt" | head -30
echo "== total $(( $(date +%s) - t0 )) s"
