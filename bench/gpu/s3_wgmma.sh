#!/usr/bin/env bash
# Session 3, call 2: the warpgroup (wgmma, sm_90a) expert GEMM tiles.
# Every CUDA test binary (TestLayerFusedTiles runs each wgmma tile against the
# first one bitwise and against the reference), compute-sanitizer memcheck on
# the wgmma tiles, then moe bench with the tuner choosing among all tiles, the
# Triton peer in the same invocation (deepseek-v2-lite 256/1024/4096,
# qwen3-30b-a3b 1024/4096), and the dual-stream timeline PNG for the README.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
S="$OUT/summary.txt"
{
timeout 150 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -3 /tmp/tests-summary.txt
grep -c -- '--- PASS' "$OUT/gpu-tests.log"; grep -E -- '--- FAIL|panic|wgmma|warpgroup' "$OUT/gpu-tests.log" | head -30
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestLayerFusedTiles/cuda/m(64n128|128n128)k64g[12]s4') > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -B2 -A8 "Invalid|Error" /tmp/memcheck.log | head -30
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$S" 2>&1
cat "$S"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
timeout 200 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 256,1024,4096 --mode single,dual,auto \
  --peer .gpu/peers/triton_fused_moe.py --out "$OUT/dsv2.md" > /tmp/dsv2.txt 2>&1
echo "dsv2 rc=$?"; tail -5 /tmp/dsv2.txt; grep -E "^\| +[0-9]" "$OUT/dsv2.md"
echo "== after dsv2: $(( $(date +%s) - t0 )) s"
timeout 150 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1024,4096 --mode single,dual,auto \
  --peer .gpu/peers/triton_fused_moe.py --out "$OUT/qwen3.md" > /tmp/qwen3.txt 2>&1
echo "qwen3 rc=$?"; tail -3 /tmp/qwen3.txt; grep -E "^\| +[0-9]" "$OUT/qwen3.md"
echo "== after qwen3: $(( $(date +%s) - t0 )) s"
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 64 --mode dual --trace /tmp/dual.json --out /tmp/dual.md > /dev/null 2>&1
echo "trace rc=$?"
python3 bench/gpu/timeline.py /tmp/dual.json "$OUT/timeline.png"
echo "== total $(( $(date +%s) - t0 )) s"
